"""`make demo` at test size: the Makefile's demo recipe, line by line as written, with size overrides appended (the
last `--set` of a key wins), in a scratch folder. Its full size and time: docs/training.md, "The demo"."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST_SIZE = {"admit": "--rollouts 2 --set sampling.max_new_tokens=16",
             "train": "--set steps=2 --set batch_size=4 --set sampling.max_new_tokens=16 --set eval.examples=4 "
                      "--set guard.every=1 --quiet"}


def demo_recipe(makefile: Path) -> list[str]:
    """The demo target's shell lines, with the Makefile's `NAME := value` variables expanded and `$$` as `$`."""
    text = makefile.read_text()
    variables = dict(re.findall(r"^(\w+) := (.*)$", text, re.M))
    body = re.search(r"^demo:.*\n((?:\t.*\n)+)", text, re.M).group(1)
    lines = [line.strip().lstrip("@") for line in body.splitlines()]
    return [re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], line).replace("$$", "$") for line in lines]


def at_test_size(line: str) -> str:
    """Runs opd from this interpreter, with the test-size flags after the command's own arguments."""
    match = re.match(r"\S+/bin/opd (\w+)(.*?)( \|\| .*)?$", line)
    if match is None:
        return line  # an echo
    command, args, tail = match.groups()
    return f"{sys.executable} -m opd.cli {command}{args} {TEST_SIZE.get(command, '')}{tail or ''}"


@pytest.mark.slow  # ~25 s of CPU: three CLI start-ups, the admission probe, an async run and the report
def test_make_demo_at_test_size(tmp_path):
    lines = demo_recipe(ROOT / "Makefile")
    commands = [line.split()[1] for line in lines if "/bin/opd " in line]
    assert commands == ["admit", "train", "report"]
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    out = []
    for line in map(at_test_size, lines):
        result = subprocess.run(["sh", "-c", line], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
        out.append(result.stdout)
    assert out[1].split()[0] in ("ADMIT", "UNCERTAIN")  # the admit line (after the first echo)
    report = tmp_path / out[-1].split()[-1]  # the demo ends with the report's path
    assert report.name == "report.html" and report.is_file() and (report.parent / "report.md").is_file()
