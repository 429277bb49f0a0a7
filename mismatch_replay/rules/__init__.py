"""The rule catalogue: every masking / truncation rule of RULES.md, one class each.

`base` holds what rules are built from (Rule, Param, Domain, TokenBatch, SeqStats and the
SEQ_STATS table, the float64/float32 arithmetic, REGISTRY); `token` the 13 token rules,
`m2po` the per-step m2po rule, `sequence` the 9 sequence rules; `spec` parses rule SPECs
and GRIDs; `catalogue` renders the registry as records and docs/rules.md's tables. Importing the
package registers the 23 rules in catalogue order; the names below are its public API.
"""

from __future__ import annotations

from .base import (
    ARITH,
    F32,
    F64,
    FRAMEWORK_OF,
    FRAMEWORK_PRECISION,
    INF,
    LOG_CLAMP,
    OPS,
    PRECISIONS,
    REGISTRY,
    SEQ_STATS,
    Domain,
    Param,
    Rule,
    SeqStat,
    SeqStats,
    TokenBatch,
    as_f64,
    band,
    binary_kl,
    binary_kl_prob,
    fmt_value,
    nan_to,
    reciprocal_spec,
    register,
    round_to,
    safe_log,
    select,
    seq_extras,
)

# The rule modules register their rules in this order, REGISTRY's (the catalogue's and a
# sweep's default jobs'): token, m2po (placed after token-k3), sequence.
# isort: off
from .token import (
    CISPO,
    DPPOKL,
    DPPOTV,
    IPO,
    TIS,
    DualClip,
    IcePop,
    IPOv1,
    KPop,
    PPOClip,
    TokenK2,
    TokenK3,
    TokenMIS,
)
from .m2po import M2PO
from .sequence import GSPO, OPSM, GeoMIS, ProbError, SeqMaxK2, SeqMeanK3, SeqMIS, SeqTIS, Veto
# isort: on

from .catalogue import catalogue, catalogue_markdown, catalogue_records, presets_markdown
from .spec import (
    MAX_GRID,
    check_grid_size,
    get_rule_class,
    parse_grid,
    parse_rule,
    spec_warnings,
)

__all__ = [
    "ARITH",
    "CISPO",
    "DPPOKL",
    "DPPOTV",
    "F32",
    "F64",
    "FRAMEWORK_OF",
    "FRAMEWORK_PRECISION",
    "GSPO",
    "INF",
    "IPO",
    "LOG_CLAMP",
    "M2PO",
    "MAX_GRID",
    "OPS",
    "OPSM",
    "PRECISIONS",
    "REGISTRY",
    "SEQ_STATS",
    "TIS",
    "Domain",
    "DualClip",
    "GeoMIS",
    "IPOv1",
    "IcePop",
    "KPop",
    "PPOClip",
    "Param",
    "ProbError",
    "Rule",
    "SeqMIS",
    "SeqMaxK2",
    "SeqMeanK3",
    "SeqStat",
    "SeqStats",
    "SeqTIS",
    "TokenBatch",
    "TokenK2",
    "TokenK3",
    "TokenMIS",
    "Veto",
    "as_f64",
    "band",
    "binary_kl",
    "binary_kl_prob",
    "catalogue",
    "catalogue_markdown",
    "catalogue_records",
    "check_grid_size",
    "fmt_value",
    "get_rule_class",
    "nan_to",
    "parse_grid",
    "parse_rule",
    "presets_markdown",
    "reciprocal_spec",
    "register",
    "round_to",
    "safe_log",
    "select",
    "seq_extras",
    "spec_warnings",
]
