"""The public API (`mismatch_replay.__all__`): real signatures, documented, and the
docs/library.md page that shows them.

For every public name: no *args / **kwargs; the options after the sources are keyword-only;
every parameter is named in the docstring (and, for a function, every field of the
dataclass it returns); `typing.get_type_hints` resolves; and the signature block of
docs/library.md is `inspect.signature` rendered (`render`). Then every example of the page
runs, and every result renders as text and HTML.

`python tests/test_public_api.py --write` rewrites the page's signature blocks from the code.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import types
import typing
from pathlib import Path

import pytest

import mismatch_replay

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "library.md"
NAMES = [n for n in mismatch_replay.__all__ if n != "__version__"]
# what a function's parameters before the keyword-only ones may be: the sources and the
# question itself (choose's target, compare's two rules, convert's output)
POSITIONAL = {
    "choose": ["sources", "target_fraction"],
    "compare": ["sources", "rule_a", "rule_b"],
    "convert": ["sources", "out"],
    "drift_runs": ["runs"],  # run name -> its sources
    "parse_rule": ["spec"],
    "TokenWriter": ["root"],
    "Param": ["name", "doc", "grid"],
}
BLOCK = re.compile(r"<!-- (signature|example): (\w+) -->\n```python\n(.*?)```", re.S)


def _ann(a) -> str:
    if isinstance(a, str):
        return a
    return getattr(a, "__name__", repr(a))


def render(name: str) -> str:
    """`inspect.signature` of a public name as the page shows it: one parameter a line."""
    sig = inspect.signature(getattr(mismatch_replay, name))
    lines = []
    star = False
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            lines.append("*")
            star = True
        s = p.name
        if p.annotation is not p.empty:
            s += f": {_ann(p.annotation)}"
        if p.default is not p.empty:
            s += f" = {p.default!r}"
        lines.append(s)
    ret = "" if sig.return_annotation is sig.empty else f" -> {_ann(sig.return_annotation)}"
    body = "".join(f"    {s},\n" for s in lines)
    return f"{name}(\n{body}){ret}\n"


def _blocks(kind: str) -> dict[str, str]:
    return {n: code for k, n, code in BLOCK.findall(PAGE.read_text()) if k == kind}


def _doc(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    if isinstance(obj, type) and obj.__init__.__doc__ and obj.__init__ is not object.__init__:
        doc += "\n" + inspect.getdoc(obj.__init__)
    return doc


def _documented(doc: str, name: str) -> bool:
    """`name:` opening a line (alone or in a list `a, name:`), or `name` in backticks."""
    listed = re.search(rf"^\s*(?:\w+, )*{name}(?:, \w+)*:", doc, re.M)
    return bool(listed or f"`{name}`" in doc)


@pytest.mark.parametrize("name", NAMES)
def test_no_var_args(name):
    sig = inspect.signature(getattr(mismatch_replay, name))
    kinds = {p.name: p.kind for p in sig.parameters.values()}
    bad = [n for n, k in kinds.items() if k in (k.VAR_POSITIONAL, k.VAR_KEYWORD)]
    assert not bad, f"{name}{sig}: var-args {bad}"


@pytest.mark.parametrize("name", NAMES)
def test_options_are_keyword_only(name):
    sig = inspect.signature(getattr(mismatch_replay, name))
    positional = [p.name for p in sig.parameters.values() if p.kind is not p.KEYWORD_ONLY]
    assert positional == POSITIONAL.get(name, ["sources"] if positional else []), sig


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_and_result_field_documented(name):
    obj = getattr(mismatch_replay, name)
    doc = _doc(obj)
    params = list(inspect.signature(obj).parameters)
    missing = [p for p in params if not _documented(doc, p)]
    assert not missing, f"{name}: parameters not in the docstring: {missing}"
    if isinstance(obj, type):
        return
    ret = typing.get_type_hints(obj)["return"]
    if dataclasses.is_dataclass(ret) and ret.__name__ != "Tally":  # Tally: internal fields
        fields = [f.name for f in dataclasses.fields(ret)]
        missing = [f for f in fields if not _documented(doc, f)]
        assert not missing, f"{name}: fields of {ret.__name__} not in the docstring: {missing}"


@pytest.mark.parametrize("name", NAMES)
def test_type_hints_resolve(name):
    obj = getattr(mismatch_replay, name)
    hints = typing.get_type_hints(obj.__init__ if isinstance(obj, type) else obj)
    params = set(inspect.signature(obj).parameters)
    assert params <= set(hints), f"{name}: unannotated {params - set(hints)}"


def test_the_page_shows_every_public_name_once():
    found = [n for k, n, _ in BLOCK.findall(PAGE.read_text()) if k == "signature"]
    assert sorted(found) == sorted(NAMES)
    assert sorted(_blocks("example")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_the_page_signature_is_the_codes(name):
    assert _blocks("signature").get(name) == render(name), (
        f"docs/library.md shows an old signature of {name}: run "
        "`python tests/test_public_api.py --write`"
    )


def test_render_follows_the_signature():
    """The renderer is no identity: a changed default or a new option shows."""

    def f(sources: str, *, k: int = 1) -> None: ...

    mismatch_replay.__dict__["_probe"] = f
    try:
        assert (
            render("_probe") == "_probe(\n    sources: str,\n    *,\n    k: int = 1,\n) -> None\n"
        )
    finally:
        del mismatch_replay.__dict__["_probe"]


def test_internal_keywords_are_refused():
    """The engine's plumbing is not public: a keyword the call does not take fails at once."""
    internal = ("tail", "seq_lengths", "shape", "jobs", "bootstrap", "robust", "final", "scatter")
    for fn in (mismatch_replay.sweep, mismatch_replay.replay):
        for kw in internal:
            with pytest.raises(TypeError, match=kw):
                fn("tests/data/golden_log.parquet", **{kw: None})
    with pytest.raises(TypeError, match="tally"):
        mismatch_replay.choose("tests/data/golden_log.parquet", 0.01, tally=None)
    with pytest.raises(TypeError, match="budget_settings"):
        mismatch_replay.compare("tests/data/golden_log.parquet", "ipo", "tis", budget_settings=())


def _example(name: str) -> None:
    """Run the page's example of `name` as a module of its own (dataclasses look their
    class's module up in sys.modules)."""
    code = _blocks("example")[name]
    mod = types.ModuleType(f"library_example_{name}")
    sys.modules[mod.__name__] = mod
    try:
        exec(compile(code, f"docs/library.md:{name}", "exec"), mod.__dict__)
    finally:
        del sys.modules[mod.__name__]


@pytest.mark.parametrize("name", NAMES, ids=lambda n: f"example-{n}")
def test_page_example_runs(name, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    _example(name)
    assert capsys.readouterr().out  # every example prints what it shows


def test_results_render_as_text_and_html():
    """print() shows the summary (not the dataclass repr), a notebook an HTML table of the
    result's rows, and to_dict() plain values."""
    log = str(ROOT / "tests" / "data" / "golden_log.parquet")
    res = mismatch_replay.sweep(log, rules=["ipo"], sweeps={"eps": "0.05:0.5:10"})
    text = str(res)
    assert text.startswith("SweepResult: 10 rows, 19,598 loss tokens")
    assert "ipo eps 0.05 .. 0.5 (10 values)" in text and "table=" not in text
    page = res._repr_html_()
    assert page.startswith('<div class="mismatch-replay-result">') and "<table" in page
    specs = res.table["spec"].to_list()
    assert len(specs) == 10 and all(f"&quot;{s}&quot;" in page for s in specs)  # every row
    assert res.to_dict()["rows"] == res.table.to_dicts()
    summary = mismatch_replay.inspect(log)
    assert str(summary).startswith("Summary: 19,598 loss tokens")
    assert summary.table.height == 8 and "<table" in summary._repr_html_()
    k = mismatch_replay.check(log, max_metric={"kl_k3": 1.0})
    assert k.passed and str(k).startswith("CheckResult: passed")
    assert k.table["limit"].to_list() == ["kl_k3"]


def test_summaries_say_what_the_tables_hold():
    """Each summary line is read off the result's own rows: a grouped sweep sums its groups
    to the whole log's fraction; the 2 x 2 table's cells add up to the tokens; the drift
    table has a row a step."""
    from mismatch_replay.present import pct

    log = str(ROOT / "tests" / "data" / "golden_log.parquet")
    whole = mismatch_replay.sweep(log, rules=["ipo:eps=0.3"])
    by_step = mismatch_replay.sweep(log, rules=["ipo:eps=0.3"], by="step")
    frac = whole.table["masked_fraction"][0]
    assert by_step.table.height == 8 and len(set(by_step.table["masked_fraction"])) > 1
    line = f"ipo:eps=0.3 masks {pct(frac)} of tokens"
    assert line in str(whole).splitlines()[1] and line in str(by_step).splitlines()[1]
    assert "by step" in str(by_step).splitlines()[0]
    cmp = mismatch_replay.compare(log, "ipo:eps=0.1", "icepop@prime-rl")
    assert cmp.table["tokens"].sum() == cmp.tokens == 19_598
    assert dict(zip(cmp.table["cell"], cmp.table["tokens"], strict=True))["both"] == cmp.both
    assert f"both {cmp.both:,}, only a {cmp.only_a:,}, only b {cmp.only_b:,}" in str(cmp)
    d = mismatch_replay.drift(log)
    assert d.table["step"].to_list() == [r.step for r in d.steps] == list(range(8))
    assert str(d).startswith("DriftResult: 8 steps")
    best = mismatch_replay.choose(log, 0.01, rules=["ipo"], bootstrap=0)
    assert best.table.to_dicts() == [best[0].to_dict()]
    assert f"eps = {best[0].value:.4g}" in str(best) and "[ok]" in str(best)


def _write() -> None:
    text = PAGE.read_text()

    def sub(m):
        kind, name, code = m.groups()
        if kind == "signature":
            code = render(name)
        return f"<!-- {kind}: {name} -->\n```python\n{code}```"

    PAGE.write_text(BLOCK.sub(sub, text))


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        _write()
        print(f"rewrote the signatures of {PAGE}")
    else:
        print(__doc__)
