"""Every command in a real terminal: a pseudo-terminal 80 and 120 columns wide, as a user's
first contact runs them (TERM=xterm-256color, stdout and stderr on the terminal).

CliRunner gives the CLI no terminal, so neither the progress line nor the tables' width
handling ever ran under it; here each command is a child process (`python -m
mismatch_replay ...`) whose stdin/stdout/stderr are the slave end of a pty sized with
TIOCSWINSZ. The raw bytes are checked for the progress line (rich draws it when it starts and
once more when it stops, then erases it: the erased frames are still in the byte stream),
and a small VT100 model of the screen (cursor moves, line erases; what a user sees after the
command ends) for the rest: exit 0, no traceback, nothing cut with an ellipsis, nothing
written past the right edge, and the rule settings and numbers each test names in full.
Runtime: about 40 s on two cores (numba's kernel is cached in __pycache__ after its first
compile, which can add 30-60 s to the first run).
"""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import polars as pl
import pytest
import typer

from mismatch_replay import cli
from mismatch_replay.cli import core, render
from mismatch_replay.viz.jobs import sample_path

pytestmark = pytest.mark.slow  # every command a child process in a pseudo-terminal

GOLDEN = str(Path(__file__).parent / "data" / "golden_log.parquet")
GOLDEN_ROWS = 20_969  # raw rows of the golden log (inspect: "rows")
WIDTHS = (80, 120)
# environment variables that would make rich ignore the terminal or its size
_RICH_ENV = ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "TERMINAL_WIDTH")
_ESC = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])|\x1b\][^\x07]*\x07")


def run_pty(args: list[str], cols: int, cwd: Path, rows: int = 40, timeout: float = 240.0):
    """Run `python -m mismatch_replay *args` in a pty of cols x rows; (exit code, raw text)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in _RICH_ENV}
    env |= {"TERM": "xterm-256color", "COLUMNS": str(cols), "LINES": str(rows)}
    env |= {"MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mismatch_replay", *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=cwd,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"{args} still running after {timeout} s")
            ready, _, _ = select.select([master], [], [], 0.2)
            if not ready:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed its end
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    return proc.wait(timeout=30), b"".join(chunks).decode("utf-8", "replace")


def screen(raw: str, cols: int) -> tuple[list[str], int]:
    """The terminal's text after `raw` (scrollback included), and how many characters were
    written past the right edge (a table or line wider than the terminal)."""
    lines: list[list[str]] = [[]]
    row = col = overflow = 0
    pos = 0
    for m in [*_ESC.finditer(raw), None]:
        text = raw[pos : m.start() if m else len(raw)]
        for ch in text:
            if ch == "\r":
                col = 0
            elif ch == "\n":
                row += 1
                col = 0
                while len(lines) <= row:
                    lines.append([])
            elif ch in "\x07\x08":
                col = max(col - (ch == "\x08"), 0)
            else:
                if col >= cols:
                    overflow += 1
                line = lines[row]
                line.extend(" " * (col + 1 - len(line)))
                line[col] = ch
                col += 1
        if m is None:
            break
        pos = m.end()
        arg, op = m.group(1), m.group(2)
        n = int(arg) if arg and arg.isdigit() else 1
        if op == "A":
            row = max(row - n, 0)
        elif op == "B":
            row += n
            while len(lines) <= row:
                lines.append([])
        elif op == "G":
            col = n - 1
        elif op == "K":
            line = lines[row]
            if arg == "2":
                line.clear()
            else:
                del line[col:]
    text = ["".join(x).rstrip() for x in lines]
    while text and not text[-1]:
        text.pop()
    return text, overflow


def plain(raw: str) -> str:
    """The raw output without escape sequences: every frame the terminal was sent."""
    return _ESC.sub("", raw)


def check(rc: int, raw: str, cols: int, label: str | None, rows: int | None = None) -> str:
    """Exit 0, no traceback, the progress line shown, the final screen readable; the final
    screen as one string."""
    text, overflow = screen(raw, cols)
    out = "\n".join(text)
    assert rc == 0, out
    assert "Traceback" not in raw, out
    assert "…" not in out, out  # nothing cut with an ellipsis
    assert overflow == 0, out  # nothing relied on the terminal wrapping a long line
    if label is not None:
        unit = "steps" if label == "simulate" else "rows"
        done = f"{rows:,}" if rows is not None else r"[\d,]+"
        progress = re.compile(rf"{label}( \(pass \d+\))? [━╸╺ ]*\s*{done}/[\d,]+ {unit}")
        assert progress.search(plain(raw)), plain(raw)[-3000:]
        assert not progress.search(out), out  # cleared when the command ends
    return out


def words(out: str) -> set[str]:
    return set(re.split(r"[\s│┃]+", out))


@pytest.fixture(scope="module")
def sample_rows() -> int:
    return pl.scan_parquet(sample_path()).select(pl.len()).collect().item()


# ----------------------------------------------------------------------------- commands


@pytest.mark.parametrize("cols", WIDTHS)
def test_rules(cols, tmp_path):
    out = check(*run_pty(["rules"], cols, tmp_path), cols, None)
    w = words(out)
    assert {"ipo", "prob-error", "@prime-rl-legacy:", "clamp=1e-06"} <= w
    assert "hi (no default)" in out


@pytest.mark.parametrize("cols", WIDTHS)
def test_inspect(cols, tmp_path):
    out = check(*run_pty(["inspect", GOLDEN], cols, tmp_path), cols, "inspect", GOLDEN_ROWS)
    w = words(out)
    assert {"19,598", "20,969", "0.002291", "kl_k3_max"} <= w  # loss tokens, rows, k3


@pytest.mark.parametrize("cols", WIDTHS)
def test_sweep(cols, tmp_path):
    args = ["sweep", GOLDEN, "-r", "ipo:eps=0.3", "-r", "ipo:eps=0.1", "-r", "dppo-kl"]
    args += ["-r", "dual-clip", "-r", "tis"]
    out = check(*run_pty(args, cols, tmp_path), cols, "sweep", GOLDEN_ROWS)
    w = words(out)
    # settings wrap between their parameters, never inside one
    assert {"[high=0.05,", "clamp=1e-06]", "[eps_high=0.2,", "c=3]"} <= w
    assert {"0.3", "0.1", "622", "0.0969%", "99.8%"} <= w
    assert "of 19,598 loss tokens" in out


@pytest.mark.parametrize("cols", WIDTHS)
def test_sweep_every_rule(cols, tmp_path):
    out = check(*run_pty(["sweep", GOLDEN], cols, tmp_path), cols, "sweep", GOLDEN_ROWS)
    w = words(out)
    assert {"[eps_low=0.2,", "eps_high=0.2]", "[eps_high=0.0004]", "seq-mean-k3"} <= w


@pytest.mark.parametrize("cols", WIDTHS)
def test_sweep_verbose_paths(cols, tmp_path):
    """--verbose: each job's path on stderr, every rule setting whole, even at 80 columns."""
    args = ["sweep", GOLDEN, "--verbose", "-o", "all.parquet"]
    out = check(*run_pty(args, cols, tmp_path), cols, "sweep", GOLDEN_ROWS)
    w = words(out)
    assert "path of each job" in out
    assert {"dual-clip:eps_low=0.2,eps_high=0.2", "dppo-kl:high=0.05,clamp=1e-06"} <= w
    assert {"fused", "simple", "eps_high", "prob-error"} <= w and "sequence rule" in out


@pytest.mark.parametrize("cols", WIDTHS)
def test_sweep_by_step(cols, tmp_path):
    args = ["sweep", GOLDEN, "--by", "step", "-r", "ipo:eps=0.3", "-r", "dual-clip"]
    out = check(*run_pty(args, cols, tmp_path), cols, "sweep", GOLDEN_ROWS)
    # the title counts the whole log, the tokens column each step (2,175 + ... = 19,598)
    assert "of 19,598 loss tokens; tokens: per step" in out.replace("\n", " ")
    w = words(out)
    assert {"2,175", "2,936", "2,717", "41.7%"} <= w
    assert "[eps_high=0.2," in w or "dual-clip [eps_high=0.2, c=3]," in out.replace("\n", " ")


@pytest.mark.parametrize("cols", WIDTHS)
def test_sweep_by_q_bucket(cols, tmp_path):
    args = ["sweep", GOLDEN, "--by", "q_bucket", "-r", "ipo", "-r", "seq-mis"]
    out = check(*run_pty(args, cols, tmp_path), cols, "sweep", GOLDEN_ROWS)
    flat = out.replace("\n", " ")
    assert "of 19,598 loss tokens; tokens: per q_bucket" in flat
    assert "seqs masked" not in flat  # a sequence spans buckets: no per-bucket sequences
    assert "sequence columns are empty" in flat
    assert {"7,902", "[0.99,", "0.198%"} <= words(out)


@pytest.mark.parametrize("cols", WIDTHS)
def test_check(cols, tmp_path):
    args = ["check", GOLDEN, "--max", "kl_k3=0.01", "--max", "mismatch_kl/all/max=1"]
    args += ["-r", "ipo:eps=0.3", "--max-masked", "0.01", "--per-step"]
    rc, raw = run_pty(args, cols, tmp_path)
    assert rc == 3, plain(raw)  # a limit exceeded: the CI gate's exit code
    out = check(0, raw, cols, "check", GOLDEN_ROWS)
    assert "mismatch_kl/all/max" in out and "EXCEEDED" in out
    assert {"ipo:eps=0.3", "EXCEEDED", "0.002291", "6.638"} <= words(out)  # whole, at 80 too
    assert "check failed: 1 of 3 limit(s) exceeded" in " ".join(out.split())


@pytest.mark.parametrize("cols", WIDTHS)
def test_choose(cols, tmp_path):
    args = ["choose", GOLDEN, "-t", "0.0025", "--bootstrap", "20"]
    out = check(*run_pty(args, cols, tmp_path), cols, "choose", GOLDEN_ROWS)
    w = words(out)
    assert {"0.06683", "[high=0.05,", "[low=0.05,", "clamp=1e-06]", "[13]"} <= w


@pytest.mark.parametrize("cols", WIDTHS)
def test_compare(cols, tmp_path):
    args = ["compare", GOLDEN, "-r", "ipo:eps=0.3", "-r", "icepop:low=0.2,high=5", "--examples"]
    out = check(*run_pty([*args, "2"], cols, tmp_path), cols, "compare", GOLDEN_ROWS)
    assert {"19,562", "0.2222", "0.09628", "[0.0001,"} <= words(out)


@pytest.mark.parametrize("cols", WIDTHS)
def test_drift(cols, tmp_path):
    out = check(*run_pty(["drift", GOLDEN], cols, tmp_path), cols, "drift", GOLDEN_ROWS)
    w = words(out)
    # the four default settings, each header and verdict the preset given in full (issue 36,
    # 7ca9cc1: the tables name the SPEC given): ipo eps 0.3 vs 0.1, icepop's lows 0.2 vs 0.5
    presets = ["ipo@prime-rl", "ipo@prime-rl-legacy", "icepop@prime-rl", "icepop@verl"]
    assert set(presets) <= w
    assert all(f"  {p}: no drift" in out for p in presets), out
    assert {"0.003339", "6.84e-05", "0.331%", "spike"} <= w


def test_drift_negative_k1(tmp_path):
    """The bundled sample: k1 is negative at some steps (step 0: -0.000227; an earlier
    sample's -2.37e-05 was cut to '-2.37e-…'), and the masked fractions' table fits too
    (step 33, IPO eps=0.1: 15.2%)."""
    out = check(*run_pty(["drift", str(sample_path())], 80, tmp_path), 80, "drift")
    assert {"-0.000227", "DRIFT", "15.2%"} <= words(out)


@pytest.mark.parametrize("cols", WIDTHS)
def test_plot(cols, tmp_path):
    args = ["plot", GOLDEN, "-o", "figs", "--image-format", "svg"]
    out = check(*run_pty(args, cols, tmp_path), cols, "plot", GOLDEN_ROWS)
    assert "figs/where_masked.svg" in out and (tmp_path / "figs" / "scatter.svg").exists()


@pytest.mark.parametrize("cols", WIDTHS)
def test_report(cols, tmp_path):
    args = ["report", GOLDEN, "-o", "rep", "--bootstrap", "20"]
    rc, raw = run_pty(args, cols, tmp_path)
    out = check(rc, raw, cols, "report", GOLDEN_ROWS)
    assert "report: rep/index.html" in out
    assert "report (pass" not in plain(raw)  # one bar through every pass (viz.jobs.Stages)
    assert f"{GOLDEN_ROWS:,}/{GOLDEN_ROWS:,} rows" in plain(raw)


@pytest.mark.parametrize("cols", WIDTHS)
def test_convert(cols, tmp_path):
    args = ["convert", GOLDEN, "-o", "canon.parquet"]
    out = check(*run_pty(args, cols, tmp_path), cols, "convert", GOLDEN_ROWS)
    assert "wrote 19,598 loss tokens (8 steps)" in out.replace("\n", " ")


@pytest.mark.parametrize("cols", WIDTHS)
def test_demo(cols, tmp_path, sample_rows):
    rc, raw = run_pty(["demo", "-o", "d"], cols, tmp_path)
    out = check(rc, raw, cols, "demo", sample_rows)
    assert "Open d/index.html in a browser." in out
    # one bar through the report's reads (the shared read, the by-length replay) and the
    # drawing: it fills once, never starting over as "(pass 2)"
    assert "demo" in plain(raw) and not re.search(r"demo \(pass \d+\)", plain(raw))


def test_simulate(tmp_path):
    args = ["simulate", "-o", "sim.parquet", "--steps", "2", "--batch", "8", "--seq-len", "16"]
    rc, raw = run_pty(args, 80, tmp_path)
    out = check(rc, raw, 80, "simulate", 2)
    assert "wrote sim.parquet: 256 tokens" in out


# ----------------------------------------------------------------------------- --help

COMMANDS = tuple(typer.main.get_command(cli.app).commands)  # every registered command


@pytest.mark.parametrize("cols", WIDTHS)
def test_top_level_help_keeps_sentences_whole(cols, tmp_path):
    out = check(*run_pty(["--help"], cols, tmp_path), cols, None)
    assert "<bool>" not in out
    # the Commands panel: each command's summary, joined over its lines, is its docstring's
    # first paragraph (typer's rich mode kept the source's line breaks: mid-sentence breaks)
    panel = out[out.index("Commands") :].splitlines()[1:]
    summary: dict[str, list[str]] = {}
    name = None
    for line in panel:
        m = re.match(r"│ (\S+)?\s+(.*?)\s*│$", line)
        if not m:
            continue
        name = m.group(1) or name
        summary.setdefault(name, []).append(m.group(2))
    cmds = typer.main.get_command(cli.app).commands
    assert set(summary) == set(COMMANDS) and len(COMMANDS) >= 11
    for n, parts in summary.items():
        first = cmds[n].help.split("\n\n")[0]
        assert "\n" not in first
        assert " ".join(parts) == first, (n, parts)


@pytest.mark.parametrize("cols", WIDTHS)
def test_command_help_shows_flags_plainly(cols, tmp_path):
    for c in COMMANDS:
        out = check(*run_pty([c, "--help"], cols, tmp_path), cols, None)
        assert "<bool>" not in out and "--help " in out, (c, out)
        assert "Usage: mismatch-replay " + c in out
    out = check(*run_pty(["plot", "--help"], cols, tmp_path), cols, None)
    assert "--image-format" in out and "png|svg|pdf" in out and "--log-format" not in out
    out = check(*run_pty(["sweep", "--help"], cols, tmp_path), cols, None)
    assert "step|env|q_bucket" in out
    assert re.search(r"--json\s+Print JSON", out) and re.search(r"--force\s+Overwrite", out)


# ----------------------------------------------------------------------------- progress line


def _progress_text(calls) -> str:
    """What the progress line prints for a sequence of update(done, total) calls."""
    from rich.console import Console

    buf = io.StringIO()
    term = Console(file=buf, force_terminal=True, width=100, color_system=None)
    old, render.err = render.err, term
    try:
        with render.progress("sweep") as cb:
            assert cb is not None
            for done, total in calls:
                cb(done, total)
    finally:
        render.err = old
    return plain(buf.getvalue())


def test_progress_line_unknown_total_estimates_and_passes():
    # unknown total (the format that crashed: {task.total:,.0f} with total None)
    assert "1,234,567 rows" in _progress_text([(1_234_567, 0)])
    assert "1,234,567/2,000,000 rows" in _progress_text([(1_234_567, 2_000_000)])
    # a count past an estimated total raises the total, it never reads 1,200/1,000
    assert "1,200/1,200 rows" in _progress_text([(1_000, 1_000), (1_200, 1_000)])
    # a log read again: a count below the last, or a finished count repeated
    text = _progress_text([(10, 10), (10, 10), (4, 10), (10, 10)])
    assert "sweep (pass 3) " in text and "10/10 rows" in text
    # without a terminal, no display and no callback
    assert not render.err.is_terminal
    with render.progress("sweep") as cb:
        assert cb is None


# ----------------------------------------------------------------------------- rough edges


def _stderr_of(fn) -> str:
    from rich.console import Console

    buf = io.StringIO()
    term = Console(file=buf, force_terminal=True, width=200, color_system=None)
    old, render.err = render.err, term
    try:
        with pytest.raises(typer.Exit):
            core.run(fn)
    finally:
        render.err = old
    return buf.getvalue()


def test_install_hints_keep_their_extras():
    """Error text is not rich markup: `[torch]`, `[ray]` used to vanish from install hints."""
    from mismatch_replay.errors import UsageError

    def fail():
        raise UsageError("--engine ray needs Ray: pip install 'mismatch-replay[ray]' [bold]x[/]")

    assert "pip install 'mismatch-replay[ray]' [bold]x[/]" in _stderr_of(fail)
