"""tests/vllm need vLLM, which lives in its own environment: `make test-vllm` (part of `make test`)
runs them there; the server's venv, which has no vLLM, leaves them out. tests/sglang need SGLang's
wheel, likewise (`make test-sglang`, its own environment). tests/gpu need torchvision
(the batched preprocessing path): `make gpu-rehearsal` (part of `make test`) runs them in the GPU
rehearsal environment."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["vllm"]
if importlib.util.find_spec("sglang") is None:
    collect_ignore.append("sglang")
if importlib.util.find_spec("torchvision") is None:
    collect_ignore.append("gpu")


def pytest_configure(config: object) -> None:
    """The suite's servers are forked from a fork server that imported the server once
    (tests/forkserver.py; ENCODE_TEST_FORK=0: fresh interpreters)."""
    from tests import server

    server.fork_servers()


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    from tests import startups

    startups.set_current_test(nodeid)


def pytest_terminal_summary(terminalreporter: object) -> None:
    """The start-up seconds of every process the run started (tests/startups.py)."""
    from tests import startups

    lines = startups.summary()
    if lines:
        terminalreporter.write_sep("=", "process start-ups")  # type: ignore[attr-defined]
        for line in lines:
            terminalreporter.write_line(line)  # type: ignore[attr-defined]
