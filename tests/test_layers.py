"""The architecture holds: `lint-imports` checks the layers contract of pyproject.toml (cli > tools > train >
checkpoint | data | plan > models > parallel > sharding | inspect | distributed > errors, and a JAX-free planner),
and the package keeps its shape (no loose top-level modules, no module over 400 lines)."""

import shutil
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "spmdkit"


def test_import_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "import-linter is not installed (it is in the dev extra)"
    done = subprocess.run([lint], capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "BROKEN" not in done.stdout and done.stdout.count("KEPT") == 2


def test_top_level_modules_and_module_sizes():
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "__main__.py", "errors.py"]
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    long = {path: lines for path, lines in sizes.items() if lines > 400}
    assert not long, f"modules over 400 lines: {long}"
