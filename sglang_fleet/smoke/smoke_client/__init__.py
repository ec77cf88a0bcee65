"""Smoke throughput benchmark for one SGLang server, standard library only.

The smoke_gate role runs it on a GPU host with the host's python3 (>= 3.9), so no module of this
package imports anything outside the standard library and the package itself. The host gets one
zipapp built from these files by ``sglang_fleet/host_zipapp.py``. From the repo:

    python3 -m sglang_fleet.smoke.smoke_client --url http://127.0.0.1:30000 --num-prompts 200 \\
        --max-concurrency 32 --random-input-len 512 --random-output-len 128 --json out.json

Flags and metric names follow SGLang's own benchmark client (``sglang.bench_serving``) where they
mean the same thing. Pass the API key through the environment (``SGLANG_API_KEY``) rather than
``--api-key``: a command line is visible to every user of the host in ``ps``.

Exit status: 0 when the run completed (even with failed requests: the gate judges), 1 when the
server could not be reached at all or stopped answering before the run (a message naming the
server, no traceback), 2 on bad usage (a message naming the flag, no traceback).

Random token ids (backend sglang) are drawn below the model's vocabulary size, as SGLang's own
benchmark draws them from its tokenizer: SGLang does not check input_ids, and one id at or above
the embedding's size kills its scheduler and the whole server. The size is --vocab-size, else
read from the model directory the server names in /model_info (config.json's vocab_size, and
tokenizer.json's ids where present: the smaller); when neither says, the run is refused.

A request counts as completed only when its answer is right: a 200 stream that ends with the
server's final record (``meta_info`` on /generate, ``usage`` on /v1/completions) reporting
exactly the completion tokens asked for (every request sets ``ignore_eos``). Anything else is
a failure with a reason (``failure_reasons`` in the result: short_output, long_output,
no_final_record, http_<status>, timeout, connect_failed, connection_closed,
malformed_response, server_error).

Speed matters more than usual here: the gate must measure the server, never this client. The
HTTP/1.1 client therefore reads a plain-HTTP socket itself (the event loop's ``add_reader`` and
``recv_into`` one preallocated buffer; HTTPS goes through asyncio's TLS transport): bytes are
parsed as they arrive, without waking a coroutine or a transport per network read, the events
of one read are taken together at the one clock reading they share, and /generate chunks are
not JSON-decoded one by one (their text is cumulative, so decoding each would cost O(n^2) per
request): the server's token count is found with a byte search, and only the last chunk of a
request is decoded. bench/README.md says how the cost is measured.

One job per module, imports absolute and among these modules only (importing the package itself
imports none of them):

- ``failures``: why a request or the run fails (the failure reasons, ServerUnreachable).
- ``server_json``: the bounded JSON reader.
- ``workload``: the configuration, request bodies, the model's vocabulary size.
- ``http_client``: the HTTP/1.1 client.
- ``streams``: one streamed request, its record and its judgement.
- ``prometheus_text``: the Prometheus text parser (also live diagnosis's).
- ``server_metrics``: the server's /metrics during the run.
- ``benchmark``: the Benchmark driver.
- ``summary``: the result JSON and its human summary.
- ``command_line``: the flags and ``main``; ``__main__`` runs it.
"""

from __future__ import annotations
