"""Hostile and broken input to every reader that takes a file whole (issue 37 §2, §3; issue 29
§7): each case must end in the tool's own error (one line naming the file and the fix, exit 1
or 2), within a second and a few MB, never a hang, a traceback, RecursionError or
MemoryError.

- §2, one test per row of the table: `--from-config` on /dev/zero, /dev/urandom, a FIFO, a
  file over the 10 MB cap, a YAML billion laughs (list and mapping forms), a self-referencing
  anchor, 500- and 1,000-deep nesting in YAML / TOML / JSON (block, flow, inline, dotted,
  header forms), a 40k-key TOML (the merge is linear: checked against the quadratic merge it
  replaced, as a brute force), a YAML over the node cap, and `choose --emit` without `-t`.
  The YAML bounds are checked with both the C and the pure-Python loader.
- §3: the same bounds on the JSON-lines readers (regular files, one line at most the line
  cap, nesting), the prime-rl trace annotations (total size cap, malformed structure), SkyRL
  pickles (regular file, size cap, a memo-slot bomb, opcode cap, refused globals) and slime
  dumps (size cap).
- Issue 29 §7: a prime-rl export whose records carry `is_masked` but no `mismatch_kl` (and one
  whose records leave out `entropy` now and then) reads, and `inspect` checks it.
- Fuzz (hypothesis): random bytes, random nested structures and truncated valid files into
  the config reader and each whole-file reader; each either parses or raises ReplayError.
  `FUZZ_CASES` counts the examples run (printed at the end of the module with -s). The fuzz
  tests are marked slow (~30 s together on 2 shared cores); the table rows are fast.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from framework_writers import (
    skyrl_classes,
    write_nemo,
    write_prime,
    write_skyrl,
    write_traces,
)

from mismatch_replay.analysis.inspect import prime_check
from mismatch_replay.cli import app
from mismatch_replay.errors import DataError, ReplayError, UsageError
from mismatch_replay.ingest import formats, safe_read
from mismatch_replay.ingest.canonical import ReadReport
from mismatch_replay.ingest.formats import prime_rl, skyrl
from mismatch_replay.integrations import config_in
from mismatch_replay.integrations.config_in import load_text, read_config
from mismatch_replay.integrations.config_out import emit
from mismatch_replay.integrations.settings import Settings

yaml = pytest.importorskip("yaml")

DATA = Path(__file__).parent / "data"
CONFIGS = Path(__file__).parent / "configs"
runner = CliRunner()
FUZZ_CASES: dict[str, int] = {}
# the errors a reader must never let out
FORBIDDEN = (RecursionError, MemoryError, yaml.YAMLError, json.JSONDecodeError, pickle.PickleError)
LOADERS = ["c", "python"] if getattr(yaml, "CSafeLoader", None) else ["python"]


@pytest.fixture(params=LOADERS)
def loader(request, monkeypatch):
    """Run a YAML case with libyaml's loader and with PyYAML's own: the bounds hold on both."""
    chosen = yaml.CSafeLoader if request.param == "c" else yaml.SafeLoader
    monkeypatch.setattr(config_in, "_yaml_loader", lambda y: chosen)
    return chosen


class Bounded:
    """Wall time and peak RSS growth of a block (ru_maxrss only grows: the growth of the
    process's peak is an upper bound of what the block added above the previous peak)."""

    def __enter__(self):
        self.rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self.mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self.rss0) / 1024
        return False

    def check(self, seconds: float = 1.0, mb: float = 20.0) -> None:
        assert self.seconds < seconds, f"took {self.seconds:.2f} s"
        assert self.mb < mb, f"peak RSS grew {self.mb:.0f} MB"


def refused(path, match: str, error=UsageError, seconds: float = 1.0) -> str:
    """read_config(path) raises `error` with `match` and the file's name, bounded."""
    with Bounded() as b, pytest.raises(error, match=match) as e:
        read_config(path)
    b.check(seconds)
    msg = str(e.value)
    assert Path(path).name in msg and "\n" not in msg
    return msg


def in_thread(fn, timeout: float = 5.0):
    """fn() in a daemon thread; fails (instead of hanging the suite) when it blocks."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"blocked for {timeout} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


# ============================================================================ §2: --from-config


@pytest.mark.parametrize("dev", ["/dev/zero", "/dev/urandom"])
def test_config_device_refused(dev):
    if not os.path.exists(dev):
        pytest.skip(f"no {dev} here")
    msg = refused(dev, "that is a device, not a regular file")
    assert "write it to a regular file" in msg


def test_config_fifo_refused_without_blocking(tmp_path):
    fifo = tmp_path / "rl.toml"
    os.mkfifo(fifo)  # nobody writes: open() would block forever
    with pytest.raises(UsageError, match=r"rl.toml: that is a named pipe \(FIFO\)"):
        in_thread(lambda: read_config(fifo))


def test_config_directory_and_missing(tmp_path):
    refused(tmp_path, "that is a directory, not a regular file.*give the file inside it")
    refused(tmp_path / "none.toml", "none.toml: no such file")


def test_config_size_cap(tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(safe_read.CONFIG_CAP + 1)  # sparse: costs no disk and no time
    msg = refused(big, r"10 MB, over the 10 MB limit for a trainer config")
    assert "kilobytes" in msg
    ok = tmp_path / "rl.toml"  # just under the cap is read (and parsed)
    ok.write_bytes(b'[trainer.loss]\ntype = "ipo"\n' + b"#" * (safe_read.CONFIG_CAP - 100) + b"\n")
    assert read_config(ok).specs() == ["ipo@prime-rl:eps=0.3"]


def test_grown_while_read_refused():
    # /proc files stat as regular files of size 0 and then read as more: the read stops at the
    # cap + 1 bytes and refuses, instead of trusting the stat
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("no /proc here")
    with pytest.raises(DataError, match="grew while being read, past the 16 bytes limit"):
        safe_read.read_bytes("/proc/self/maps", 16, "test file", "")


def _laughs(mapping: bool, levels: int = 9) -> str:
    if mapping:
        lines = ["a0: &a0 {" + ", ".join(f"x{j}: lol" for j in range(9)) + "}"]
        for i in range(1, levels + 1):
            lines.append(f"a{i}: &a{i} {{" + ", ".join(f"y{j}: *a{i - 1}" for j in range(9)) + "}")
    else:
        lines = ["a0: &a0 [" + ",".join(["lol"] * 9) + "]"]
        for i in range(1, levels + 1):
            lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join([*lines, "trainer: {loss: {type: ipo}}"]) + "\n"


@pytest.mark.parametrize("mapping", [True, False], ids=["mappings", "lists"])
def test_yaml_billion_laughs(tmp_path, loader, mapping):
    p = tmp_path / "laughs.yaml"
    p.write_text(_laughs(mapping))
    refused(p, r"more than 100,000 nodes with its aliases expanded")


def test_yaml_few_aliases_still_read(tmp_path, loader):
    # anchors and merge keys as real configs use them stay readable
    p = tmp_path / "verl.yaml"
    p.write_text(
        "base: &b {rollout_is: token, rollout_is_threshold: 2.0}\n"
        "algorithm:\n  rollout_correction:\n    <<: *b\n"
    )
    assert read_config(p).specs() == ["tis@verl:cap=2"]


@pytest.mark.parametrize(
    "text",
    [
        "a: &x\n  b: *x\ntrainer: {loss: {type: ipo}}\n",
        "a: &x [1, *x]\n",
        "a: &x {b: [{c: *x}]}\n",
    ],
    ids=["mapping", "list", "nested"],
)
def test_yaml_self_reference(tmp_path, loader, text):
    p = tmp_path / "cycle.yaml"
    p.write_text(text)
    refused(p, r"line \d+: the alias \*x is inside its own anchor &x")


def _deep(form: str, n: int) -> tuple[str, str]:
    """(suffix, text) nesting n levels in one of the forms of the issue's table."""
    if form == "yaml-block":
        return ".yaml", "".join("  " * i + f"k{i}:\n" for i in range(n)) + "  " * n + "v: 1\n"
    if form == "yaml-flow":
        return ".yaml", "a: " + "[" * n + "]" * n + "\n"
    if form == "json-array":
        return ".json", '{"a": ' + "[" * n + "]" * n + "}"
    if form == "json-object":
        return ".json", '{"a":' * n + "1" + "}" * n
    if form == "toml-inline-array":
        return ".toml", "a = " + "[" * n + "]" * n + "\n"
    if form == "toml-inline-table":
        return ".toml", "a = " + "{b = " * n + "1" + "}" * n + "\n"
    if form == "toml-dotted":
        return ".toml", ".".join(f"k{i}" for i in range(n)) + " = 1\n"
    if form == "toml-header":
        return ".toml", "[" + ".".join(f"k{i}" for i in range(n)) + "]\nx = 1\n"
    raise AssertionError(form)


DEEP_FORMS = [
    "yaml-block",
    "yaml-flow",
    "json-array",
    "json-object",
    "toml-inline-array",
    "toml-inline-table",
    "toml-dotted",
    "toml-header",
]


@pytest.mark.parametrize("n", [500, 1000])
@pytest.mark.parametrize("form", DEEP_FORMS)
def test_deep_nesting(tmp_path, form, n):
    suffix, text = _deep(form, n)
    p = tmp_path / f"deep{suffix}"
    p.write_text(text)
    refused(p, r"nests (more than 64 levels deep|deeper than its parser can follow)")


@pytest.mark.parametrize("form", DEEP_FORMS)
def test_depth_limit_is_exact(form):
    """64 levels of containers are read, 65 refused, in every form (and for YAML on both
    loaders: the event walk counts what the composer would build)."""
    top = 0 if form in ("json-object", "toml-dotted") else 1  # the top-level mapping
    for n, ok in ((config_in.MAX_DEPTH - top, True), (config_in.MAX_DEPTH + 1 - top, False)):
        suffix, text = _deep(form, n)
        syntax = config_in.TREE_SUFFIXES[suffix]
        if ok:
            assert load_text(text, "t", syntax).tree is not None
        else:
            with pytest.raises(UsageError, match="nests more than 64 levels deep"):
                load_text(text, "t", syntax)


def test_deep_yaml_c_stack_safe(loader):
    # 100,000 levels: composing this with libyaml's loader overflows the C stack (a segfault);
    # the event walk refuses it first, at level 65
    with Bounded() as b, pytest.raises(UsageError, match="nests more than 64"):
        load_text("a: " + "[" * 100_000 + "]" * 100_000 + "\n", "t.yaml", "yaml")
    b.check()


def test_yaml_node_cap(tmp_path, loader, monkeypatch):
    # PyYAML's own parser walks events ~8x slower than libyaml's: its case runs at a cap of
    # 5,000 nodes (the same code), libyaml's at the real 100,000
    cap = config_in.MAX_NODES if loader is not yaml.SafeLoader else 5_000
    monkeypatch.setattr(config_in, "MAX_NODES", cap)
    p = tmp_path / "wide.yaml"
    keys = "".join(f"k{i}: {i}\n" for i in range(cap // 2 + 10))
    p.write_text("trainer:\n  loss:\n    type: ipo\n" + keys)
    assert p.stat().st_size < safe_read.CONFIG_CAP
    refused(p, rf"holds more than {cap:,} nodes")
    few = "".join(f"k{i}: {i}\n" for i in range(2_000))
    p.write_text("trainer:\n  loss:\n    type: ipo\n" + few)
    assert read_config(p).specs() == ["ipo@prime-rl:eps=0.3"]


def test_json_toml_node_cap(tmp_path):
    p = tmp_path / "wide.json"
    p.write_text(json.dumps({"a": list(range(config_in.MAX_NODES + 1))}))
    refused(p, r"the JSON holds more than 100,000 values")


def test_toml_values_counted_before_parsing(tmp_path):
    # 1.2M array items in 8.5 MB: tomllib took 8.9 s to parse them before the node cap
    p = tmp_path / "wide.toml"
    p.write_text('[trainer.loss]\ntype = "ipo"\na = [' + ",".join(["1"] * 1_200_000) + "]\n")
    refused(p, r"the TOML holds more than 100,000 keys and array items")


def test_shell_text_word_cap(tmp_path):
    # a 9.5 MB file of overrides took 17 s in shlex; refused from a word count first
    p = tmp_path / "overrides.txt"
    p.write_text("".join(f"algorithm.rollout_correction.k{i}=v{i} \\\n" for i in range(25_000)))
    refused(p, r"50,000 words, over the limit of 20,000 for a training script")
    p.write_text("algorithm.rollout_correction.rollout_is=token\n" + "# pad\n" * 9_000)
    assert read_config(p).specs() == ["tis@verl:cap=2"]


def test_c_loader_used_where_installed():
    if not getattr(yaml, "CSafeLoader", None):
        pytest.skip("PyYAML without libyaml")
    assert config_in._yaml_loader(yaml) is yaml.CSafeLoader


def _quadratic_assign(s: dict, where: dict, key, value, origin) -> None:
    """The merge Settings.assign replaced (73fe7de), as the brute force."""
    for k in [k for k in s if k.startswith(key + ".")]:
        s.pop(k)
        where.pop(k, None)
    parts = key.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent in s and not isinstance(s[parent], dict):
            s.pop(parent)
            where.pop(parent, None)
    s[key] = value
    where[key] = origin


def _quadratic_delete(s: dict, where: dict, key) -> None:
    for k in [k for k in s if k == key or k.startswith(key + ".")]:
        s.pop(k)
        where.pop(k, None)


_KEYS = st.lists(st.sampled_from(["a", "b", "c", ""]), min_size=1, max_size=4).map(".".join)


@settings(max_examples=100)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["set", "del"]), _KEYS, st.one_of(st.integers(0, 3), st.just({}))
        ),
        max_size=25,
    )
)
def test_settings_merge_matches_quadratic(ops):
    s, ref, where = Settings(), {}, {}
    for i, (op, key, value) in enumerate(ops):
        if op == "set":
            s.assign(key, value, f"f{i}")
            _quadratic_assign(ref, where, key, value, f"f{i}")
        else:
            s.delete(key)
            _quadratic_delete(ref, where, key)
        assert list(s.items()) == list(ref.items())
        assert s.where == where
        for p in {".".join(key.split(".")[:j]) for j in range(1, 4)}:
            below = {k[len(p) + 1 :]: v for k, v in ref.items() if k.startswith(p + ".")}
            assert s.under(p) == below
            assert s.has(p) == (p in ref or bool(below))


def test_40k_keys_linear(tmp_path):
    flat = {"trainer.loss.type": "ipo", **{f"extra.key_{i}": i for i in range(40_000)}}
    t = time.perf_counter()
    s = Settings()
    for k, v in flat.items():
        s.assign(k, v, "rl.toml")
    seconds = time.perf_counter() - t
    assert len(s) == 40_001 and s.under("trainer.loss") == {"type": "ipo"}
    assert seconds < 1.0, f"merging 40k keys took {seconds:.1f} s (quadratic: ~170 s)"
    p = tmp_path / "rl.toml"  # and the whole file through read_config (tomllib dominates)
    p.write_text(
        '[trainer.loss]\ntype = "ipo"\n[extra]\n'
        + "".join(f"key_{i} = {i}\n" for i in range(40_000))
    )
    with Bounded() as b:
        assert read_config(p).specs() == ["ipo@prime-rl:eps=0.3"]
    b.check(seconds=3.0, mb=60)


def test_flatten_iterative_and_cycle():
    deep: dict = {}
    node = deep
    for i in range(5000):  # deeper than any recursion would go
        node[f"k{i}"] = {}
        node = node[f"k{i}"]
    node["v"] = 1
    (key,) = config_in.flatten(deep)
    assert key.count(".") == 5000
    shared = {"x": 1}
    assert config_in.flatten({"a": shared, "b": shared}) == {"a.x": 1, "b.x": 1}
    loop: dict = {"a": {}}
    loop["a"]["b"] = loop
    with pytest.raises(UsageError, match=r"refers to itself at 'a\.b'"):
        config_in.flatten(loop)


def _choose_row(target):
    return {
        "rule": "ipo",
        "spec": "ipo:eps=0.3",
        "param": "eps",
        "value": 0.3,
        "masked_fraction": 0.00436,
        "target_fraction": target,
        "ci_low": 0.00399 if target is None else 0.28,
        "ci_high": 0.004763 if target is None else 0.31,
        "kind": "mask",
        "status": "ok",
        "note": "",
        "tokens": 204_800,
    }


def test_emit_header_without_target_names_the_fraction():
    text = emit("prime-rl", [_choose_row(None)])
    assert "#   95% interval of the masked fraction: 0.399% .. 0.476%" in text
    assert "interval of the threshold" not in text
    text = emit("prime-rl", [_choose_row(0.005)])
    assert "#   95% interval of the threshold: 0.28 .. 0.31" in text


# ============================================================================ CLI, one line each


@pytest.fixture(scope="module")
def small_log(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("log") / "log.parquet"
    pl.read_parquet(DATA / "golden_log.parquet").filter(pl.col("step") < 2).write_parquet(p)
    return p


def _cli_cases(tmp: Path) -> list[tuple[str, str]]:
    fifo = tmp / "fifo.toml"
    os.mkfifo(fifo)
    big = tmp / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(safe_read.CONFIG_CAP + 1)
    (tmp / "laughs.yaml").write_text(_laughs(True))
    (tmp / "cycle.yaml").write_text("a: &x\n  b: *x\n")
    (tmp / "deep.json").write_text(_deep("json-array", 1000)[1])
    (tmp / "deep.toml").write_text(_deep("toml-dotted", 1000)[1])
    return [
        ("/dev/zero", "not a regular file"),
        (str(fifo), "named pipe"),
        (str(big), "over the 10 MB limit"),
        (str(tmp / "laughs.yaml"), "aliases expanded"),
        (str(tmp / "cycle.yaml"), "inside its own anchor"),
        (str(tmp / "deep.json"), "nests deeper than its parser can follow"),
        (str(tmp / "deep.toml"), "nests more than 64 levels deep"),
    ]


def test_cli_one_line_each(tmp_path, small_log):
    for cfg, match in _cli_cases(tmp_path):
        t = time.perf_counter()
        res = in_thread(
            lambda cfg=cfg: runner.invoke(app, ["sweep", str(small_log), "--from-config", cfg])
        )
        assert time.perf_counter() - t < 2.0
        assert res.exit_code == 2, (cfg, res.output)
        assert res.exception is None or isinstance(res.exception, SystemExit)
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert len(lines) == 1, res.output
        assert lines[0].startswith("error: ") and match in lines[0], lines[0]
        assert Path(cfg).name in lines[0]
        assert "Traceback" not in res.output


def test_cli_data_readers_one_line(tmp_path, monkeypatch):
    """The §3 refusals through the CLI: exit 1 (bad data), one line naming the file."""
    monkeypatch.setenv(safe_read.ENV_CAP, "1")
    noline = tmp_path / "log.jsonl"
    noline.write_bytes(b'{"trainer_logprob": -0.1, "inference_logprob": -0.2}\n' + b" " * (3 << 20))
    bomb = tmp_path / "global_step_0_training_input.pkl"
    bomb.write_bytes(b"\x80\x02N" + b"r" + struct.pack("<I", 1 << 28) + b".")
    dump = tmp_path / "train_0.pt"
    with open(dump, "wb") as f:
        f.truncate(3 << 20)
    cases = [
        (noline, "line 2: longer than 1 MB without a newline"),
        (bomb, "memo slot 268,435,456"),
        (dump, "over the 1 MB limit for a slime train dump"),
    ]
    for path, match in cases:
        res = runner.invoke(app, ["inspect", str(path)])
        assert res.exit_code == 1, (path, res.output)
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), res.output
        assert match in lines[0] and path.name in lines[0], lines[0]


# ============================================================================ §3: data readers


def _read_all(fmt: str, path: Path, drop: bool = False) -> int:
    """Probe and read one file of a format as ingest does; the rows read."""
    probe = formats.probe(fmt, path, drop, {})
    if probe is None:
        return 0
    wanted = set(probe.columns) | {"step", "loss_mask"}
    rows = 0
    for df in formats.read(
        fmt, path, None, probe.schema, wanted, drop, ReadReport(), 4096, 1 << 16
    ):
        rows += df.height
    return rows


@pytest.fixture(scope="module")
def golden() -> pl.DataFrame:
    return pl.read_parquet(DATA / "golden_log.parquet").filter(pl.col("step") < 2)


def test_jsonl_fifo_and_device_refused(tmp_path):
    fifo = tmp_path / "rank_0.jsonl"
    os.mkfifo(fifo)
    for fmt in ("jsonl", "prime-rl", "nemo-rl"):
        with pytest.raises(DataError, match="named pipe"):
            in_thread(lambda fmt=fmt: _read_all(fmt, fifo))
    if os.path.exists("/dev/zero"):
        with pytest.raises(DataError, match="that is a device"):
            _read_all("jsonl", Path("/dev/zero"))


def test_jsonl_line_cap(tmp_path, monkeypatch):
    monkeypatch.setenv(safe_read.ENV_CAP, "1")  # 1 MB: lines and whole files
    p = tmp_path / "log.jsonl"
    p.write_bytes(b'{"trainer_logprob": -0.1, "inference_logprob": -0.2}\n' + b" " * (3 << 20))
    with Bounded() as b, pytest.raises(DataError, match=r"log.jsonl, line 2: longer than 1 MB"):
        _read_all("jsonl", p)
    b.check(mb=40)
    p.write_bytes(b"[" * (3 << 20))  # the probe's first line
    with pytest.raises(DataError, match=r"line 1: longer than 1 MB without a newline"):
        _read_all("jsonl", p)
    monkeypatch.setenv(safe_read.ENV_CAP, "lots")
    with pytest.raises(DataError, match="MISMATCH_REPLAY_MAX_FILE_MB='lots' is not a number"):
        _read_all("jsonl", p)


@settings(max_examples=100)
@given(
    lines=st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"")), max_size=12),
    last_newline=st.booleans(),
    block=st.integers(1, 20),
)
def test_blocks_are_the_file_in_whole_lines(tmp_path_factory, lines, last_newline, block):
    """blocks() (pieces of a line kept in a list) against splitting the file by lines: the
    same bytes, cut only after a newline, each block's first line number right."""
    from mismatch_replay.ingest.formats.jsonl import blocks

    data = b"\n".join(lines) + (b"\n" if last_newline and lines else b"")
    p = tmp_path_factory.mktemp("b") / "x.jsonl"
    p.write_bytes(data)
    out = list(blocks(p, block))
    joined = b"".join(b for b, _ in out)
    assert data.startswith(joined) and not data[len(joined) :].strip()  # a blank tail dropped
    assert len(data) - len(joined) <= len(data) - (data.rfind(b"\n") + 1)
    n = 1
    for blk, first in out:
        assert first == n
        assert blk.endswith(b"\n") or blk is out[-1][0]
        n += blk.count(b"\n")


def test_jsonl_deep_line_is_a_bad_record(tmp_path):
    p = tmp_path / "log.jsonl"
    good = b'{"trainer_logprob": -0.1, "inference_logprob": -0.2}\n'
    p.write_bytes(good + b'{"trainer_logprob": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n" + good)
    with pytest.raises(DataError, match=r"line 2: not valid JSON \(nested deeper"):
        _read_all("jsonl", p)
    assert _read_all("jsonl", p, drop=True) == 2


def test_prime_export_without_mismatch_kl(tmp_path, golden):
    """Issue 29 §7: is_masked without mismatch_kl was a polars ShapeError in _explode."""

    def drop_kl(step, k, rec):
        rec.pop("mismatch_kl")

    src = write_prime(golden, tmp_path / "a", edit=drop_kl)
    check = prime_check([src])
    assert check is not None and check.tokens > 0 and check.kl_tokens == 0
    assert check.agree == check.tokens


@pytest.mark.slow
def test_prime_export_without_mismatch_kl_cli(tmp_path, golden):
    """The same through `inspect`, as the issue ran it (exit 0, the check line, no traceback)."""

    def drop_kl(step, k, rec):
        rec.pop("mismatch_kl")

    src = write_prime(golden, tmp_path / "a", edit=drop_kl)
    res = runner.invoke(app, ["inspect", str(src)])
    assert res.exit_code == 0, res.output
    assert "agree with prime-rl's is_masked" in res.output


def test_prime_export_optional_key_left_out_sometimes(tmp_path, golden):
    def drop_some(step, k, rec):
        if k % 2:
            rec.pop("entropy")
            rec.pop("mismatch_kl")

    src = write_prime(golden, tmp_path / "b", edit=drop_some)
    files = sorted(src.rglob("rank_*.jsonl"))
    total = sum(_read_all("prime-rl", f) for f in files)
    want = sum(
        len(json.loads(line)["trainer_logprobs"])
        for f in files
        for line in f.read_text().splitlines()
        if line.strip()
    )
    assert total == want
    assert prime_check([src]).tokens > 0


def _traces(tmp_path, golden) -> Path:
    return write_traces(golden, tmp_path / "run") / "monitors" / "file" / "traces" / "stream.jsonl"


def test_trace_annotations_capped(tmp_path, golden, monkeypatch):
    stream = _traces(tmp_path, golden)
    ann = stream.parent / "annotations" / "trainer.jsonl"
    with open(ann, "ab") as f:
        f.truncate(ann.stat().st_size + (2 << 20))  # 2 MB over a 1 MB cap
    monkeypatch.setenv(safe_read.ENV_CAP, "1")
    prime_rl._ANNOTATION_CACHE.clear()
    with (
        Bounded() as b,
        pytest.raises(
            DataError, match=r"annotations: \d annotation file\(s\) of .* over the 1 MB limit"
        ),
    ):
        _read_all("prime-rl-traces", stream)
    b.check()


def test_trace_annotation_fifo_refused(tmp_path, golden):
    stream = _traces(tmp_path, golden)
    os.mkfifo(stream.parent / "annotations" / "other.jsonl")
    prime_rl._ANNOTATION_CACHE.clear()
    with pytest.raises(DataError, match=r"other.jsonl: that is a named pipe"):
        in_thread(lambda: _read_all("prime-rl-traces", stream))


@pytest.mark.parametrize(
    "node",
    [5, "x", {"token_ids": 3, "mask": [True]}, {"token_ids": [1], "mask": "ab"}],
    ids=["int", "str", "int-tokens", "str-mask"],
)
def test_trace_malformed_nodes_are_bad_records(tmp_path, golden, node):
    stream = _traces(tmp_path, golden)
    lines = stream.read_text().splitlines()
    rec = json.loads(lines[0])
    rec["traces"][0]["nodes"][-1] = node
    lines[0] = json.dumps(rec)
    stream.write_text("\n".join(lines) + "\n")
    prime_rl._ANNOTATION_CACHE.clear()
    with pytest.raises(DataError, match=r"stream.jsonl, line 1: "):
        _read_all("prime-rl-traces", stream)
    assert _read_all("prime-rl-traces", stream, drop=True) > 0


def _skyrl_file(tmp_path, golden) -> Path:
    d = write_skyrl(golden.filter(pl.col("step") == 0), tmp_path / "sky")
    return next(d.glob("*.pkl"))


def test_skyrl_fifo_and_cap(tmp_path, monkeypatch):
    fifo = tmp_path / "global_step_1_training_input.pkl"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="named pipe"):
        in_thread(lambda: skyrl.load_skyrl(fifo))
    p = tmp_path / "global_step_2_training_input.pkl"
    with open(p, "wb") as f:
        f.truncate(3 << 20)  # refused on its size, before a byte is unpickled
    monkeypatch.setenv(safe_read.ENV_CAP, "1")
    with (
        Bounded() as b,
        pytest.raises(
            DataError, match=r"3 MB, over the 1 MB limit for a SkyRL batch pickle.*MAX_FILE_MB"
        ),
    ):
        skyrl.load_skyrl(p)
    b.check()


def test_skyrl_memo_bomb(tmp_path):
    p = tmp_path / "global_step_0_training_input.pkl"
    # 9 bytes: put None in memo slot 2**28 (the C unpickler would allocate 4 GB of slots)
    p.write_bytes(b"\x80\x02N" + b"r" + struct.pack("<I", 1 << 28) + b".")
    with Bounded() as b, pytest.raises(DataError, match="memo slot 268,435,456 after 3 opcodes"):
        skyrl.load_skyrl(p)
    b.check()


def test_skyrl_opcode_cap(tmp_path, monkeypatch):
    p = tmp_path / "global_step_0_training_input.pkl"
    p.write_bytes(pickle.dumps(list(range(100))))
    monkeypatch.setattr(skyrl, "MAX_PICKLE_OPS", 50)
    with pytest.raises(DataError, match="more than 50 opcodes"):
        skyrl.load_skyrl(p)
    monkeypatch.setattr(skyrl, "MAX_PICKLE_OPS", 1000)  # under the cap: read, then refused
    with pytest.raises(DataError, match="the pickle holds a list, not a SkyRL"):
        skyrl.load_skyrl(p)


def test_skyrl_refused_global_says_pickles_run_code(tmp_path):
    p = tmp_path / "global_step_0_training_input.pkl"
    p.write_bytes(pickle.dumps(os.system))  # names posix.system: a pickle that runs a command
    with pytest.raises(DataError, match="A pickle can run any code it names"):
        skyrl.load_skyrl(p)


def _sky_pickle(path: Path, pad) -> Path:
    """A small SkyRL batch pickle (2 rows x 3 tokens), as the stand-in classes write it."""
    arr = {"format": "numpy", "shape": (2, 3), "dtype": "float32"}
    logp = dict(arr, data=np.full((2, 3), -0.5, np.float32).tobytes())
    ones = dict(arr, data=np.ones((2, 3), np.float32).tobytes())
    state = {
        "batch_dict": {
            "action_log_probs": logp,
            "rollout_logprobs": logp,
            "loss_mask": ones,
            "response_mask": ones,
        },
        "batch_size": 2,
        "metadata": {"pad_size": pad},
    }
    with skyrl_classes() as tb:
        path.write_bytes(pickle.dumps(tb.TrainingInputBatch(__state__=state)))
    return path


@pytest.mark.parametrize("pad", [-1, 10**9, "3", 2.5, [1]])
def test_skyrl_bad_pad_size(tmp_path, pad):
    p = _sky_pickle(tmp_path / "global_step_0_training_input.pkl", pad)
    with pytest.raises(DataError, match=r"metadata pad_size = .* not a count of padding rows"):
        _read_all("skyrl", p)
    skyrl._SKYRL_CACHE.clear()
    assert _read_all("skyrl", _sky_pickle(p, 1)) == 3  # one row of padding left out


def test_slime_cap(tmp_path, monkeypatch):
    p = tmp_path / "train_0.pt"
    with open(p, "wb") as f:
        f.truncate(3 << 20)  # refused on its size, before torch is imported or opens it
    monkeypatch.setenv(safe_read.ENV_CAP, "1")
    with Bounded() as b, pytest.raises(DataError, match=r"3 MB, over the 1 MB limit for a slime"):
        formats.probe("slime", p, False, {})
    b.check()


# ============================================================================ fuzz


def _outcome(name: str, fn) -> None:
    """fn() parses, or raises the tool's own error; anything else fails the example."""
    FUZZ_CASES[name] = FUZZ_CASES.get(name, 0) + 1
    t = time.perf_counter()
    try:
        fn()
    except ReplayError as exc:
        assert str(exc).strip()
    except FORBIDDEN as exc:  # pragma: no cover - the failure being tested for
        raise AssertionError(f"{name}: {type(exc).__name__} escaped: {exc}") from exc
    assert time.perf_counter() - t < 2.0, (
        f"{name}: one example took {time.perf_counter() - t:.1f} s"
    )


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=8),
)
_TREES = st.recursive(
    _SCALARS,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.dictionaries(st.text(min_size=1, max_size=6), kids, max_size=4),
    ),
    max_leaves=30,
)
_CONFIG_FILES = sorted(CONFIGS.iterdir())


def _config_case(tmp: Path, suffix: str, data: bytes) -> None:
    p = tmp / f"fuzz{suffix}"
    p.write_bytes(data)
    _outcome("config", lambda: read_config(p))


@pytest.mark.slow
@settings(max_examples=150)
@given(
    suffix=st.sampled_from([".toml", ".yaml", ".json", ".sh", ".txt"]),
    data=st.binary(max_size=300),
)
def test_fuzz_config_random_bytes(tmp_path_factory, suffix, data):
    _config_case(tmp_path_factory.mktemp("c"), suffix, data)


@pytest.mark.slow
@settings(max_examples=150)
@given(
    tree=st.dictionaries(st.text(min_size=1, max_size=6), _TREES, max_size=5),
    syntax=st.sampled_from(["json", "yaml", "anchors"]),
)
def test_fuzz_config_random_structures(tmp_path_factory, tree, syntax):
    if syntax == "json":
        data = json.dumps(tree).encode()
        suffix = ".json"
    else:
        text = yaml.safe_dump(tree, allow_unicode=True)
        if syntax == "anchors":  # every value an alias of the first: expansion and cycles
            text = "x: &x " + json.dumps(tree) + "\n" + text.replace(": ", ": *x #", 3)
        data = text.encode()
        suffix = ".yaml"
    _config_case(tmp_path_factory.mktemp("c"), suffix, data)


@pytest.mark.slow
@settings(max_examples=150)
@given(
    i=st.integers(0, len(_CONFIG_FILES) - 1),
    cut=st.floats(0, 1),
    flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=3),
)
def test_fuzz_config_truncated_valid(tmp_path_factory, i, cut, flips):
    src = _CONFIG_FILES[i]
    data = bytearray(src.read_bytes()[: int(len(src.read_bytes()) * cut)])
    for at, byte in flips:
        if data:
            data[int(at * (len(data) - 1))] = byte
    _config_case(tmp_path_factory.mktemp("c"), src.suffix, bytes(data))


@pytest.fixture(scope="module")
def valid_files(tmp_path_factory, golden) -> dict[str, Path]:
    """One valid file per whole-file reader, to truncate and corrupt."""
    tmp = tmp_path_factory.mktemp("valid")
    one = golden.filter(pl.col("step") == 0)
    out = {
        "prime-rl": next(write_prime(one, tmp / "p").rglob("rank_0.jsonl")),
        "nemo-rl": next(write_nemo(one, tmp / "n").rglob("*.jsonl")),
        "skyrl": next(write_skyrl(one, tmp / "s").glob("*.pkl")),
    }
    plain = tmp / "log.jsonl"
    with open(plain, "w") as f:
        for row in one.head(200).iter_rows(named=True):
            f.write(json.dumps(row) + "\n")
    out["jsonl"] = plain
    traces = write_traces(one, tmp / "t") / "monitors" / "file" / "traces"
    out["prime-rl-traces"] = traces / "stream.jsonl"
    out["annotations"] = traces / "annotations" / "trainer.jsonl"
    try:
        from framework_writers import write_slime

        pytest.importorskip("torch")

        out["slime"] = next(write_slime(one, tmp / "sl").glob("*.pt"))
    except ImportError:  # pragma: no cover - torch is a dev dependency
        pass
    return out


READERS = ["jsonl", "prime-rl", "nemo-rl", "prime-rl-traces", "annotations", "skyrl", "slime"]


def _reader_case(tmp: Path, valid: dict[str, Path], reader: str, data: bytes) -> None:
    """Write `data` where `reader` reads it (in a copy of its valid tree) and read it."""
    if reader not in valid:
        pytest.skip(f"no {reader} fixture (torch missing)")
    src = valid[reader]
    if reader in ("prime-rl-traces", "annotations"):
        d = tmp / "traces"
        (d / "annotations").mkdir(parents=True)
        stream = d / "stream.jsonl"
        stream.write_bytes(src.read_bytes() if reader == "annotations" else data)
        (d / "annotations" / "trainer.jsonl").write_bytes(
            data if reader == "annotations" else valid["annotations"].read_bytes()
        )
        prime_rl._ANNOTATION_CACHE.clear()
        _outcome(reader, lambda: _read_all("prime-rl-traces", stream))
        _outcome(reader, lambda: _read_all("prime-rl-traces", stream, drop=True))
        return
    p = tmp / src.parent.name / src.name
    p.parent.mkdir(parents=True)
    p.write_bytes(data)
    skyrl._SKYRL_CACHE.clear()
    _outcome(reader, lambda: _read_all(reader, p))
    if reader not in ("skyrl", "slime"):
        _outcome(reader, lambda: _read_all(reader, p, drop=True))


@pytest.mark.slow
@settings(max_examples=60)
@given(reader=st.sampled_from(READERS), data=st.binary(max_size=400))
def test_fuzz_readers_random_bytes(tmp_path_factory, valid_files, reader, data):
    _reader_case(tmp_path_factory.mktemp("r"), valid_files, reader, data)


@pytest.mark.slow
@settings(max_examples=60)
@given(
    reader=st.sampled_from(READERS),
    cut=st.floats(0, 1),
    flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=4),
)
def test_fuzz_readers_truncated_valid(tmp_path_factory, valid_files, reader, cut, flips):
    if reader not in valid_files:
        pytest.skip(f"no {reader} fixture (torch missing)")
    full = valid_files[reader].read_bytes()
    data = bytearray(full[: int(len(full) * cut)])
    for at, byte in flips:
        if data:
            data[int(at * (len(data) - 1))] = byte
    _reader_case(tmp_path_factory.mktemp("r"), valid_files, reader, bytes(data))


@pytest.mark.slow
@settings(max_examples=60)
@given(
    reader=st.sampled_from(["slime", "skyrl"]),
    how=st.sampled_from(["bytes", "cut", "flip"]),
    data=st.binary(max_size=300),
    cut=st.floats(0, 1),
    flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=6),
)
def test_fuzz_dumps(tmp_path_factory, valid_files, reader, how, data, cut, flips):
    """The two binary dumps on their own (the draws above spread over seven readers): random
    bytes, the valid dump cut short, the valid dump with bytes overwritten."""
    if reader not in valid_files:
        pytest.skip(f"no {reader} fixture (torch missing)")
    full = valid_files[reader].read_bytes()
    if how == "cut":
        data = full[: int(len(full) * cut)]
    elif how == "flip":
        buf = bytearray(full)
        for at, byte in flips:
            buf[int(at * (len(buf) - 1))] = byte
        data = bytes(buf)
    _reader_case(tmp_path_factory.mktemp("d"), valid_files, reader, data)


def _json_lines_of(trees: list, wrap: dict | None = None) -> bytes:
    lines = []
    for t in trees:
        obj = dict(wrap, **({"x": t} if not isinstance(t, dict) else t)) if wrap else t
        lines.append(json.dumps(obj, allow_nan=True))
    return ("\n".join(lines) + "\n").encode()


_PRIME_KEYS = ["trainer_logprobs", "inference_logprobs", "loss_mask", "is_masked", "entropy"]
_TRACE_KEYS = ["id", "traces", "nodes", "token_ids", "mask", "logprobs", "parent", "env"]
_ANN_KEYS = ["trace_id", "branches", "index", "trainer_logprobs", "is_masked", "info"]


def _keyed_trees(keys: list[str]):
    """Nested structures whose keys are the reader's own (so they get past the key checks)."""
    leaf = st.one_of(_SCALARS, st.lists(_SCALARS, max_size=4))
    return st.recursive(
        leaf,
        lambda kids: st.one_of(
            st.lists(kids, max_size=3), st.dictionaries(st.sampled_from(keys), kids, max_size=5)
        ),
        max_leaves=25,
    )


@pytest.mark.slow
@settings(max_examples=80)
@given(
    reader=st.sampled_from(["jsonl", "prime-rl", "nemo-rl", "prime-rl-traces", "annotations"]),
    data=st.data(),
)
def test_fuzz_readers_random_structures(tmp_path_factory, valid_files, reader, data):
    keys = {
        "prime-rl": _PRIME_KEYS,
        "jsonl": ["trainer_logprob", "inference_logprob", "step", "loss_mask"],
        "nemo-rl": ["token_ids", "generation_logprobs", "prev_logprobs", "token_loss_mask"],
        "prime-rl-traces": _TRACE_KEYS,
        "annotations": _ANN_KEYS,
    }[reader]
    records = data.draw(st.lists(_keyed_trees(keys), min_size=1, max_size=4))
    _reader_case(tmp_path_factory.mktemp("r"), valid_files, reader, _json_lines_of(records))


def _mutate(obj, data, depth: int = 0):
    """`obj` with one subtree (reached by drawn keys / indexes) replaced by a drawn value: a
    random structure, a scalar, a deep nesting, or the subtree's key removed."""
    if isinstance(obj, dict | list) and obj and depth < 8 and data.draw(st.integers(0, 3)):
        keys = list(obj) if isinstance(obj, dict) else list(range(len(obj)))
        k = keys[data.draw(st.integers(0, len(keys) - 1))]
        out = dict(obj) if isinstance(obj, dict) else list(obj)
        if isinstance(out, dict) and not data.draw(st.integers(0, 5)):
            del out[k]  # a key the writer left out
        else:
            out[k] = _mutate(obj[k], data, depth + 1)
        return out
    return data.draw(
        st.one_of(
            _TREES,
            st.integers(1, 2000).map(lambda n: json.loads("[" * n + "]" * n) if n < 900 else []),
            st.lists(st.floats(allow_nan=True) | st.none() | st.booleans(), max_size=12),
        )
    )


def _hot_spots(rec, reader: str) -> list[tuple]:
    """(container, key) pairs deep in a valid record where the trace readers walk: each
    node of each trace (its token_ids, mask, logprobs, parent), each annotated branch."""
    out: list[tuple] = []
    if not isinstance(rec, dict):
        return out
    if reader == "prime-rl-traces":
        for t in rec.get("traces") or []:
            for node in t.get("nodes") or []:
                out += [(node, k) for k in node]
            out += [(t["nodes"], j) for j in range(len(t.get("nodes") or []))]
    elif reader == "annotations":
        for br in rec.get("branches") or []:
            out += [(br, k) for k in br]
        out += [(rec, k) for k in rec]
    return out


@pytest.mark.slow
@settings(max_examples=120)
@given(
    reader=st.sampled_from(["jsonl", "prime-rl", "nemo-rl", "prime-rl-traces", "annotations"]),
    data=st.data(),
)
def test_fuzz_readers_mutated_records(tmp_path_factory, valid_files, reader, data):
    """Valid records with subtrees replaced or removed: gets past each reader's key checks
    into the code that walks the structure (trace nodes, branches, streams, arrays)."""
    lines = [ln for ln in valid_files[reader].read_text().splitlines() if ln.strip()][:4]
    recs = [json.loads(ln) for ln in lines]
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(recs) - 1))
        spots = _hot_spots(recs[i], reader)
        if spots and data.draw(st.booleans()):  # deep inside: a trace node, a branch
            holder, key = spots[data.draw(st.integers(0, len(spots) - 1))]
            holder[key] = _mutate(holder[key], data)
        else:
            recs[i] = _mutate(recs[i], data)
    body = "\n".join(json.dumps(r, allow_nan=True) for r in recs) + "\n"
    _reader_case(tmp_path_factory.mktemp("m"), valid_files, reader, body.encode())


SKYRL_KEYS = ["action_log_probs", "rollout_logprobs", "loss_mask", "response_mask"]
SKYRL_KEYS += ["attention_mask", "advantages"]


@pytest.mark.slow
@settings(max_examples=80)
@given(
    state=st.fixed_dictionaries(
        {},
        optional={
            "batch_dict": st.dictionaries(
                st.sampled_from(SKYRL_KEYS),
                st.one_of(
                    _TREES,
                    st.builds(
                        lambda shape, dt: {
                            "format": "numpy",
                            "data": np.zeros(shape, dt).tobytes(),
                            "shape": shape,
                            "dtype": dt,
                        },
                        st.tuples(st.integers(0, 3), st.integers(0, 4))
                        | st.tuples(st.integers(0, 4)),
                        st.sampled_from(["float32", "float64", "int64", "bool", "object"]),
                    ),
                ),
            ),
            "metadata": _TREES,
            "batch_size": _TREES,
        },
    )
)
def test_fuzz_skyrl_random_structures(tmp_path_factory, state):
    p = tmp_path_factory.mktemp("s") / "global_step_0_training_input.pkl"
    with skyrl_classes() as tb:
        p.write_bytes(pickle.dumps(tb.TrainingInputBatch(__state__=state)))
    skyrl._SKYRL_CACHE.clear()
    _outcome("skyrl", lambda: _read_all("skyrl", p))


@pytest.mark.slow
def test_zz_fuzz_case_count():
    """The examples the fuzz tests above ran (in a full run of this module)."""
    total = sum(FUZZ_CASES.values())
    print(
        f"\nfuzz cases: {total:,} ({', '.join(f'{k} {v}' for k, v in sorted(FUZZ_CASES.items()))})"
    )
    if FUZZ_CASES:
        assert total >= 100
