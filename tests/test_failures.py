"""Failures around a run: a full or read-only disk under the run directory or the checkpoint directory stops the run
within seconds with one line and a non-zero exit, and the last checkpoint stays intact; metrics.jsonl is appended
line-atomically and rewritten through a rename; a partial last line is dropped with a warning."""

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import error_lines, run_spmdkit

from spmdkit.errors import SpmdkitError
from spmdkit.train.reporting.metrics import MetricsWarning, MetricsWriter, append_line, read_metrics, trim_metrics

# ----------------------------------------------------------------------------------------------- metrics.jsonl


def test_a_failed_append_leaves_no_partial_line(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    append_line(path, '{"step": 1}\n')
    real_write = os.write

    def half_then_full(fd, data):  # a disk that fills up in the middle of the line
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError):
        append_line(path, '{"step": 2, "loss": 1.5}\n')
    monkeypatch.undo()
    assert path.read_text() == '{"step": 1}\n'


def test_writer_on_a_full_disk_raises_one_line_at_once(tmp_path):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    writer = MetricsWriter(tmp_path)
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    with pytest.raises(SpmdkitError) as info:
        writer.write({"step": 1, "loss": 2.0})
    assert "metrics.jsonl (No space left on device)" in str(info.value) and "\n" not in str(info.value)
    writer.close()


def test_partial_last_line_is_dropped_with_a_warning_and_trim_rewrites_by_rename(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n{"step": 3, "lo')  # killed mid-write
    with pytest.warns(MetricsWarning, match="dropped its unfinished last line"):
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]

    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append((Path(a).parent, Path(b))), real_replace(a, b)))
    with pytest.warns(MetricsWarning):
        trim_metrics(tmp_path, 1)
    assert replaced == [(tmp_path, path)]  # a temporary file beside it, renamed over it
    assert path.read_text() == '{"step": 1, "loss": 3.0}\n'

    def killed(a, b):
        raise KeyboardInterrupt  # a stop between writing the temporary file and the rename

    monkeypatch.setattr(os, "replace", killed)
    path.write_text('{"step": 1}\n{"step": 2}\n')
    with pytest.raises(KeyboardInterrupt):
        trim_metrics(tmp_path, 1)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n' and sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]


def test_an_unreadable_line_in_the_middle_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(SpmdkitError, match="metrics.jsonl line 2 is not JSON"):
        read_metrics(tmp_path)


# ----------------------------------------------------------------------------------------------- full disks

TRAIN = (
    "train --cpu-devices 2 --mesh fsdp=2 --steps 100000 --log-every 1 --checkpoint-every 2 --no-progress "
    "--seq-len 32 --batch-size 4 --dtype float32 --eval-every 0"
).split()


@contextlib.contextmanager
def unwritable_disk(where: Path, kind: str):
    """(a directory, a function that makes it unwritable mid-run, the OS reason expected, a command prefix).

    kind "full": a 64 MiB tmpfs, filled mid-run, where this process may mount one (root); else, as the acceptance
    allows, the "read-only" kind: the directory and its files made read-only mid-run (root ignores file modes, so
    as root the run starts without CAP_DAC_OVERRIDE, through setpriv).
    """
    where.mkdir()
    if kind == "full" and os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], capture_output=True)
        if mounted.returncode == 0:

            def fill() -> None:
                # The run's own saves may have filled the disk first: then opening the filler fails, as wanted.
                with contextlib.suppress(OSError), open(where / "filler", "wb") as f:
                    while True:
                        f.write(b"\0" * 2**20)
                        f.flush()

            try:
                yield where, fill, "No space left on device", []
            finally:
                subprocess.run(["umount", "-l", str(where)], capture_output=True)
            return
    prefix = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("root without setpriv: file modes cannot make a directory read-only here")
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]

    def chmod_tree(directory_mode: int, file_mode: int) -> None:
        # Top-down (a directory before its entries), while the run still writes: Orbax renames and deletes its
        # temporary files meanwhile, so a path the walk listed may be gone by the time it is reached.
        for root, _, files in os.walk(where):
            for path, mode in ((root, directory_mode), *((os.path.join(root, f), file_mode) for f in files)):
                with contextlib.suppress(FileNotFoundError):
                    os.chmod(path, mode)

    try:
        yield where, lambda: chmod_tree(0o555, 0o444), "Permission denied", prefix
    finally:
        chmod_tree(0o755, 0o644)


def _logged(run_dir: Path) -> int:
    with contextlib.suppress(FileNotFoundError, ValueError):
        return len((run_dir / "metrics.jsonl").read_text().splitlines())
    return 0


@pytest.mark.parametrize(
    "kind, full", [("full", "run directory"), ("full", "checkpoint directory"), ("read-only", "checkpoint directory")]
)
def test_a_full_disk_stops_the_run_with_one_line_and_the_last_checkpoint_verifies(tmp_path, kind, full):
    with unwritable_disk(tmp_path / "disk", kind) as (disk, fill, reason, prefix):
        run_dir = disk / "run" if full == "run directory" else tmp_path / "run"
        checkpoints = tmp_path / "ckpt" if full == "run directory" else disk / "ckpt"
        places = ["--run-dir", str(run_dir), "--checkpoint-dir", str(checkpoints)]
        command = [*prefix, sys.executable, "-m", "spmdkit", *TRAIN, *places]
        with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
            process = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        try:
            deadline = time.monotonic() + 240
            while _logged(run_dir) < 7:  # steps 2, 4 and 6 saved (or being saved)
                assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()[-3000:]
                time.sleep(0.05)
            fill()
            filled = time.monotonic()
            code = process.wait(timeout=60)
            elapsed = time.monotonic() - filled
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        stderr = (tmp_path / "err").read_text()
        assert code == 2 and elapsed < 30, (code, elapsed, stderr[-3000:])
        assert stderr.strip().splitlines() == error_lines(stderr), stderr[-3000:]  # nothing but the one line
        (line,) = error_lines(stderr)
        assert reason in line and (
            "checkpoint step" in line if full == "checkpoint directory" else "cannot write" in line
        )
        verified = run_spmdkit("ckpt", "verify", str(checkpoints))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "damaged" not in verified.stdout and " steps intact" in verified.stdout
