"""model_source in the inventory (sglang_fleet/servers/model_source.py): checked before any host is
touched,
one copy per model_path per host (docs/STAGING.md)."""

from __future__ import annotations

import json

import pytest

from sglang_fleet.servers.describe import resolve_servers
from sglang_fleet.servers.launch_line import to_argv
from sglang_fleet.servers.model_source import (
    StageConfigError,
    check_model_source,
    host_copies,
    protected_paths,
    stage_summary,
)
from sglang_fleet.servers.server_values import ServerConfigError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _server(name: str, path: str, source: dict | None) -> dict:
    server = {"name": name, "model_path": path, "port": 30000, "gpus": [0]}
    if source is not None:
        server["model_source"] = source
    return server


def test_one_copy_per_model_path_however_many_servers_load_it() -> None:
    source = {"rsync": "store:/srv/llama/rev-a/", "revision": "rev-a"}
    plan = host_copies(
        [
            _server("a", "/models/llama/rev-a", source),
            _server("b", "/models/llama/rev-a/", source),
            _server("c", "/models/other", None),
        ]
    )
    assert plan == [
        {
            "path": "/models/llama/rev-a",
            "source": {"rsync": "store:/srv/llama/rev-a", "revision": "rev-a"},
            "servers": ["a", "b"],
        }
    ]


def test_two_sources_for_one_path_are_refused_naming_both_servers() -> None:
    with pytest.raises(
        StageConfigError, match=r"\[b\]\.model_source: model_path /m/x is also loaded by a"
    ):
        host_copies(
            [
                _server("a", "/m/x", {"rsync": "/shared/x", "revision": "r1"}),
                _server("b", "/m/x", {"rsync": "/shared/x", "revision": "r2"}),
            ]
        )


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ({"rsync": "/s", "hf_repo": "o/n", "revision": "r"}, "needs one of"),
        ({"revision": "r"}, "needs one of"),
        ({"rsync": "/s"}, "revision: must be a non-empty string"),
        ({"rsync": "relative/path", "revision": "r"}, "not an absolute path"),
        ({"rsync": "-e sh", "revision": "r"}, "not an absolute path"),
        ({"rsync": "host:/a/../etc", "revision": "r"}, "no '..'"),
        ({"rsync": "/s", "revision": "r", "size": 1}, "model_source.size: unknown key"),
        ({"hf_repo": "o/n", "revision": "main"}, "pin a Hugging Face source to a commit"),
        ({"hf_repo": "not a repo", "revision": COMMIT}, "not an org/name repo id"),
        ({"rsync": "/s", "revision": "r", "manifest": "../m.json"}, "a file name"),
        ("store:/x", "must be a mapping"),
    ],
)
def test_a_bad_model_source_names_the_variable(source: object, fragment: str) -> None:
    with pytest.raises(StageConfigError) as err:
        check_model_source(source, "sglang_server_instances[a]", "/models/a")
    assert str(err.value).startswith("sglang_server_instances[a].model_source")
    assert fragment in str(err.value)


def test_a_staged_model_path_must_be_absolute() -> None:
    with pytest.raises(StageConfigError, match=r"\[a\]\.model_path"):
        check_model_source({"rsync": "/s", "revision": "r"}, "sglang_server_instances[a]", "org/x")


def test_a_pinned_hugging_face_source_passes() -> None:
    source = check_model_source({"hf_repo": "org/llama", "revision": COMMIT}, "s[a]", "/m/a")
    assert source == {"hf_repo": "org/llama", "revision": COMMIT}


def test_the_resolver_keeps_the_source_and_refuses_a_bad_one_by_name() -> None:
    good = _server("a", "/models/a", {"rsync": "store:/srv/a", "revision": "r1"})
    described = resolve_servers([good], {}, {}, {})
    assert described[0]["model_source"] == {"rsync": "store:/srv/a", "revision": "r1"}
    plain = resolve_servers([_server("a", "/models/a", None)], {}, {}, {})
    assert plain[0]["model_source"] is None
    bad = _server("a", "/models/a", {"rsync": "store:/srv/a"})
    with pytest.raises(ServerConfigError, match=r"model_source\.revision"):
        resolve_servers([bad], {}, {}, {})


def test_every_model_path_is_protected_from_pruning() -> None:
    servers = [_server("a", "/m/a/", None), _server("b", "/m/b", None)]
    assert protected_paths(servers) == ["/m/a", "/m/b"]


def test_the_summary_keeps_each_copy_s_figures_by_model_path() -> None:
    results = [
        {
            "item": {"path": "/m/a"},
            "changed": True,
            "copy_seconds": 12.5,
            "bytes": 10,
            "stdout": "x",
        },
        {"item": {"path": "/m/b"}, "changed": False, "copy_seconds": 0.0},
        {"skipped": True},
    ]
    summary = stage_summary(results)
    assert summary["/m/a"]["copy_seconds"] == 12.5 and summary["/m/a"]["bytes"] == 10
    assert "stdout" not in summary["/m/a"]
    assert summary["/m/b"]["changed"] is False
    assert set(summary) == {"/m/a", "/m/b"}


def test_multithreaded_loading_is_a_server_flag_that_reaches_the_launch_line() -> None:
    """docs/STAGING.md, "Multithreaded loading": the inventory asks for it in flags."""
    server = _server("a", "/models/a", {"rsync": "store:/srv/a", "revision": "r1"})
    server["flags"] = {
        "model_loader_extra_config": {"enable_multithread_load": True, "num_threads": 8}
    }
    flags = resolve_servers([server], {}, {}, {})[0]["flags"]
    argv = to_argv(flags)
    index = argv.index("--model-loader-extra-config")
    assert json.loads(argv[index + 1]) == {"enable_multithread_load": True, "num_threads": 8}


@pytest.mark.parametrize(
    ("model_path", "source", "variable"),
    [
        ("/models/llama/rev-a\n", {"rsync": "/s/a", "revision": "r"}, "model_path"),
        ("/models/llama/rev\x00a", {"rsync": "/s/a", "revision": "r"}, "model_path"),
        ("/", {"rsync": "/s/a", "revision": "r"}, "model_path"),
        ("/rev-a", {"rsync": "/s/a", "revision": "r"}, "model_path"),
        ("/models/./rev-a", {"rsync": "/s/a", "revision": "r"}, "model_path"),
        ("/models/a", {"rsync": "rsync://store/srv/a", "revision": "r"}, "model_source.rsync"),
        ("/models/a", {"rsync": "store::models/a", "revision": "r"}, "model_source.rsync"),
        ("/models/a", {"rsync": "/", "revision": "r"}, "model_source.rsync"),
        ("/models/a", {"rsync": "store:/", "revision": "r"}, "model_source.rsync"),
        ("/models/a", {"rsync": "//store/a", "revision": "r"}, "model_source.rsync"),
    ],
)
def test_what_used_to_reach_the_host_is_refused_naming_the_variable(
    model_path: str, source: dict, variable: str
) -> None:
    """Issue 33: a model_path with a newline or a NUL, '/', rsync's daemon forms and a source
    of '/' reached the host."""
    with pytest.raises(StageConfigError) as err:
        host_copies([_server("a", model_path, source)])
    assert err.value.variable == f"sglang_server_instances[a].{variable}", str(err.value)
