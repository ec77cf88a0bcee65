"""plugins/filter/ml_env.py: the ml_env role's requirement specifiers, read with packaging.

What is checked: a name is PEP 503-normalised and a pin kept as given (a +cpu local version
included); extras stay in the spec pip gets; the CPU set leaves SGLang out; anything but name,
name[extras] and name==version fails naming the spec, and so does input over the bounds; unmet
requirements are those not installed or at another version; the Requires-Python clauses an
interpreter misses, as written.
"""

from __future__ import annotations

import pytest
from ansible.errors import AnsibleFilterError
from conftest import load_plugin

ML_ENV = load_plugin("plugins/filter/ml_env.py")


def test_requirements_are_normalised_and_pinned_as_given() -> None:
    reqs = ML_ENV.ml_env_requirements(["Flash_Attn", "torch==2.5.1+cpu", "vllm[audio]==0.6.0"])
    assert reqs == [
        {"name": "flash-attn", "version": None, "spec": "Flash_Attn"},
        {"name": "torch", "version": "2.5.1+cpu", "spec": "torch==2.5.1+cpu"},
        {"name": "vllm", "version": "0.6.0", "spec": "vllm[audio]==0.6.0"},
    ]


def test_the_cpu_set_leaves_sglang_out() -> None:
    reqs = ML_ENV.ml_env_requirements(["SGLang==0.5.23", "numpy==2.1.0"], skip=["sglang"])
    assert [req["name"] for req in reqs] == ["numpy"]


@pytest.mark.parametrize(
    "spec",
    ["torch>=2.4", "torch==2.4,<3", "torch @ https://example.invalid/t.whl",
     "torch; python_version>'3'", "==1.0", "x" * 201],
)  # fmt: skip
def test_anything_but_a_name_or_an_exact_pin_fails_naming_it(spec: str) -> None:
    with pytest.raises(AnsibleFilterError, match="ml_env_requirements"):
        ML_ENV.ml_env_requirements([spec])


def test_the_inputs_are_bounded_and_typed() -> None:
    with pytest.raises(AnsibleFilterError, match="at most"):
        ML_ENV.ml_env_requirements(["numpy"] * (ML_ENV.MAX_SPECS + 1))
    with pytest.raises(AnsibleFilterError, match="list of strings"):
        ML_ENV.ml_env_requirements("numpy")
    assert ML_ENV.ml_env_requirements(None) == []


def test_unmet_requirements_are_missing_or_at_another_version() -> None:
    reqs = ML_ENV.ml_env_requirements(["numpy==2.1.0", "torch==2.5.1+cpu", "einops", "rich"])
    installed = {"numpy": "2.1.0", "torch": "2.5.1", "einops": "0.8.0"}
    assert [req["spec"] for req in ML_ENV.ml_env_unmet(reqs, installed)] == [
        "torch==2.5.1+cpu",
        "rich",
    ]
    with pytest.raises(AnsibleFilterError, match="mapping"):
        ML_ENV.ml_env_unmet(reqs, ["numpy"])


@pytest.mark.parametrize(
    ("version", "clauses", "misses"),
    [
        ("3.11.4", [[">=", "3.11"]], []),
        ("3.10.12", [[">=", "3.11"]], [">=3.11"]),
        ("3.14.0", [[">=", "3.10"], ["<", "3.14"]], ["<3.14"]),
        ("3.11.4", [["==", "3.11"]], ["==3.11"]),
        ("not a version", [[">=", "3.10"]], [">=3.10"]),
    ],
)
def test_the_python_clauses_an_interpreter_misses(
    version: str, clauses: list, misses: list
) -> None:
    assert ML_ENV.ml_env_python_misses(version, clauses) == misses


def test_a_clause_that_is_not_an_operator_and_a_version_fails() -> None:
    with pytest.raises(AnsibleFilterError, match="operator, version"):
        ML_ENV.ml_env_python_misses("3.11", [None])
