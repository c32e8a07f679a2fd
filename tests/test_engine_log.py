"""`verl_ext.vllm.engine_log`: where `verl-ext ab --engine-log FILE` sends the local engines'
output, checked with a spawned process that configures vLLM's logging the way an engine
process does (its EngineCore and workers: `vllm.logger.configure_logging` with the engine's
`LoggingConfig`). The real engines: tests/test_ab_cli.py::test_ab_end_to_end."""

import logging
import os
import subprocess
import sys

import pytest

from verl_ext.vllm.engine_log import EngineLog, counts, note


#: what an engine process does: configure vLLM's logging from the engine's config (a
#: ``LoggingConfig`` with the config file), log through the ``vllm`` logger, and write to its
#: descriptors outside any logger
ENGINE_LIKE = """
import logging, os, sys
from vllm.config import LoggingConfig
from vllm.logger import configure_logging

configure_logging(LoggingConfig(configure_logging=True, pylogging_config_file=sys.argv[1]))
log = logging.getLogger("vllm.v1.engine.core")
log.info("child info record")
log.warning("child warning record")
log.error("child error record")
print("child print to stdout", flush=True)
os.write(2, b"child raw write to fd 2\\n")
"""


def test_engine_processes_write_to_the_file_and_the_driver_keeps_its_terminal(tmp_path, capfd):
    pytest.importorskip("vllm")
    path = tmp_path / "sub" / "engines.log"
    path.parent.mkdir()
    path.write_text("a previous run's log\n")
    log = EngineLog(path, level="INFO")  # (conftest sets VLLM_LOGGING_LEVEL=WARNING)
    assert path.read_text() == ""  # emptied: one run, one log
    cfg = log.engine_args()["logging_config"]
    assert cfg.pylogging_config_file == log.config_file
    with log.capture():  # started inside the block, the child keeps the file as its stdout and stderr
        child = subprocess.Popen([sys.executable, "-c", ENGINE_LIKE, cfg.pylogging_config_file])
    os.write(1, b"driver write to fd 1 after the block\n")
    assert child.wait(120) == 0

    # the driver's vLLM records: to the file, and ERROR ones to its stderr as well
    from vllm.logger import configure_logging

    configure_logging(cfg)
    logging.getLogger("vllm.v1.engine.async_llm").warning("driver warning record")
    logging.getLogger("vllm.v1.engine.async_llm").error("driver error record")
    print("driver print after configuring", flush=True)

    text = path.read_text()
    lines = text.splitlines()
    for message in ("child info record", "child warning record", "child error record", "driver warning record",
                    "driver error record"):
        (line,) = [x for x in lines if x.endswith(message)]  # once each: the engine's stderr handler drops it
        assert line.startswith("(") and " pid=" in line  # vLLM's format: process name and pid first
    assert f"pid={child.pid}) ERROR" in text and f"pid={os.getpid()}) ERROR" in text
    assert "child print to stdout" in text and "child raw write to fd 2" in text
    out, err = capfd.readouterr()
    assert "driver write to fd 1 after the block" in out and "driver print after configuring" in out
    assert "child" not in out + err and "driver warning record" not in err
    assert err.strip().endswith("driver error record")

    c = counts(path)
    assert c["warnings"] == 2 and len(c["errors"]) == 2 and c["lines"] == len(lines)
    head, *errors = note(path).splitlines()
    assert head.startswith(f"engine logs: {path} (") and "2 warnings, 2 errors" in head
    assert [e.strip() for e in errors] == c["errors"]


def test_capture_restores_the_descriptors_after_an_error(tmp_path, capfd):
    log = EngineLog(tmp_path / "e.log")
    with pytest.raises(RuntimeError):
        with log.capture():
            os.write(1, b"inside\n")
            raise RuntimeError("engine start failed")
    os.write(1, b"outside\n")
    os.write(2, b"outside err\n")
    out, err = capfd.readouterr()
    assert "outside" in out and "outside err" in err and "inside" not in out
    assert (tmp_path / "e.log").read_text() == "inside\n"


def test_unwritable_log_path_is_a_one_line_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--engine-log: cannot write"):
        EngineLog(tmp_path / "file" / "engines.log")
