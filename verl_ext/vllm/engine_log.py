"""Local vLLM engines' output in a file instead of the terminal (``verl-ext ab --engine-log FILE``).

An in-process vLLM 0.32 engine (``AsyncLLM``) writes from three kinds of processes: this one,
its ``EngineCore`` process and that one's workers. It writes in two ways:

* log records of the ``vllm`` logger, which every one of those processes configures from the
  engine's ``LoggingConfig`` (engine argument ``logging_config``): ``AsyncLLM.__init__`` here,
  ``EngineCoreProc.run_engine_core`` and the multiproc executor's workers in theirs
  (``vllm.logger.configure_logging``). Its ``pylogging_config_file`` is a ``logging.dictConfig``
  JSON file; :class:`EngineLog` writes one whose handler appends to the log file. (vLLM versions
  without ``LoggingConfig`` read the file's name from ``VLLM_LOGGING_CONFIG_PATH`` in each
  process, which the engine processes inherit from :meth:`EngineLog.capture`.)
* straight to file descriptors 1 and 2: what the engine processes print outside the ``vllm``
  logger, e.g. Python warnings, torch's C++ warnings (NUMA binding) and the weight loader's
  progress bar. Those processes are started (multiprocessing's ``spawn``) while the engine
  starts and keep the descriptors 0-2 they inherit, so :meth:`EngineLog.capture` points this
  process's descriptors 1 and 2 at the log file while an engine starts, and back afterwards.

Once the engines run, this process's own output (progress bars, tables, its Python warnings)
goes to the terminal as before; its ``vllm`` records go to the file. ``vllm`` records of
level ERROR and above are also written to this process's stderr (a second handler with a filter
that passes records of this process only: in the engine processes stderr is the file already),
and :meth:`EngineLog.note` sums up the file (warnings, errors, the error lines) for the user.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Optional

#: vLLM's own format (``vllm.logger._FORMAT``): process name and pid first, so the lines of
#: several engines in one file stay apart (``vllm_process_name`` is set by the record factory
#: that vLLM installs wherever it configures logging)
FORMAT = "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
#: where vLLM processes look for a logging config when nothing else names one
CONFIG_ENV = "VLLM_LOGGING_CONFIG_PATH"


class OnlyProcess(logging.Filter):
    """Passes the records of the process with id ``pid`` (the ``logging.dictConfig`` filter of
    the stderr handler: engine processes, whose stderr is the log file, drop them)."""

    def __init__(self, pid: int):
        super().__init__()
        self.pid = int(pid)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.process == self.pid


def logging_config(path: str, pid: int, level: str = "INFO") -> dict:
    """The ``logging.dictConfig`` of every engine process: ``vllm`` records of ``level`` and up
    appended to ``path``; ERROR and up also to the stderr of process ``pid`` (the driver)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,  # the driver's other loggers stay as they are
        "formatters": {
            "vllm": {"format": FORMAT, "datefmt": DATE_FORMAT},
        },
        "filters": {"driver": {"()": f"{__name__}.OnlyProcess", "pid": pid}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": path, "mode": "a", "encoding": "utf-8",
                     "formatter": "vllm", "level": level},
            "stderr": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "vllm",
                       "level": "ERROR", "filters": ["driver"]},
        },
        "loggers": {"vllm": {"handlers": ["file", "stderr"], "level": level, "propagate": False}},
    }


class EngineLog:
    """The log file of one run's local engines. Creating it empties ``path`` (creating its
    directory) and writes the logging config beside this process's temporary files."""

    def __init__(self, path: str | os.PathLike, level: Optional[str] = None):
        self.path = Path(path).resolve()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_bytes(b"")
        except OSError as exc:
            raise ValueError(f"--engine-log: cannot write '{path}' ({exc.strerror or exc})") from None
        level = (level or os.environ.get("VLLM_LOGGING_LEVEL") or "INFO").upper()
        fd, config = tempfile.mkstemp(prefix="verl_ext-engine-logging-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(logging_config(str(self.path), os.getpid(), level), f)
        self.config_file = config
        atexit.register(_unlink, config)  # engine processes read it when they start

    def engine_args(self) -> dict:
        """The vLLM engine arguments that send the ``vllm`` logger of every engine process to
        the file (``logging_config``); none on vLLM versions without ``LoggingConfig``, whose
        engine processes read ``VLLM_LOGGING_CONFIG_PATH`` instead (set in :meth:`capture`)."""
        try:
            from vllm.config import LoggingConfig
        except ImportError:
            return {}
        return {"logging_config": LoggingConfig(configure_logging=True, pylogging_config_file=self.config_file)}

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Descriptors 1 and 2 of this process append to the file inside the block (engine
        processes spawned in it keep them), and ``VLLM_LOGGING_CONFIG_PATH`` names the logging
        config (they inherit it); both are restored after the block."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        saved = [os.dup(1), os.dup(2)]
        env = os.environ.get(CONFIG_ENV)
        try:
            os.environ[CONFIG_ENV] = self.config_file
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            yield
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for x in (fd, *saved):
                os.close(x)
            if env is None:
                os.environ.pop(CONFIG_ENV, None)
            else:
                os.environ[CONFIG_ENV] = env

    def note(self, max_errors: int = 5) -> str:
        return note(self.path, max_errors)


def counts(path: str | os.PathLike) -> dict:
    """The log file's lines, WARNING records, ERROR (and CRITICAL) lines and Python tracebacks."""
    lines = warnings = tracebacks = 0
    errors: list[str] = []
    with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            lines += 1
            if " WARNING " in line:
                warnings += 1
            elif " ERROR " in line or " CRITICAL " in line:
                errors.append(line.rstrip("\n"))
            elif line.startswith("Traceback (most recent call last)"):
                tracebacks += 1
    return {"lines": lines, "warnings": warnings, "errors": errors, "tracebacks": tracebacks}


def note(path: str | os.PathLike, max_errors: int = 5) -> str:
    """One line for the user about the log file at ``path``, then its first ERROR lines."""
    c = counts(path)
    head = (f"engine logs: {display_path(Path(path).resolve())} ({c['lines']} lines: {c['warnings']} warnings, "
            f"{len(c['errors'])} errors, {c['tracebacks']} tracebacks)")
    return "\n".join([head, *("  " + e for e in c["errors"][:max_errors])])


def display_path(path: Path) -> str:
    """``path`` relative to the working directory where it is under it, else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
