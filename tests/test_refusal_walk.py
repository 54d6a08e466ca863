"""Every start-up refusal, walked through the plugin's torchrun.

``python -m megatron_metp.megatron_lm torchrun ... pretrain_gpt.py FLAGS`` promises that a
configuration the ranks would refuse stops before any rank starts: one line, exit code 2. The
ranks refuse in ``megatron_lm.remap_and_validate`` on what Megatron-LM's own ``parse_args``
returned (its defaults included); the launcher rebuilds that namespace from the flags alone
(``check_launch``). The two can drift apart (a Megatron-LM default the launcher does not know,
a flag it spells differently), so:

- ``test_every_refusal_site_is_walked``: the cases below reach every refusal of
  ``validation.py`` and of the module rules it calls (traced line by line), every entry of its
  range table and of each mode's unsupported-feature table, and for each one the plugin's
  torchrun, run in this process with the ``exec`` of torchrun replaced by a failure, prints one
  line naming the flag and returns 2.
- ``test_the_ranks_refuse_what_the_launcher_refuses`` (where a Megatron-LM core_v0.16.1 tree
  is given): each case's flags parsed by Megatron-LM's own parser, as every rank parses them,
  then the plugin's rank-side check: the ranks refuse with the very line the launcher printed.
"""

from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from megatron_metp import megatron_lm as mlm
from megatron_metp import validation

ROOT = Path(__file__).resolve().parent.parent

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
        "--attention-dropout", "0"]
METP = ["--tensor-parallel-mode", "metp", "--tensor-model-parallel-size", "2",
        "--sequence-parallel"]
WALL = ["--tensor-parallel-mode", "wallfacer", "--tensor-model-parallel-size", "4"]
TP2 = ["--tensor-model-parallel-size", "2"]

# A bad value per range rule (validation._VALUE_RULES), by the rule's bound.
_BAD = {">= 1": "0", ">= 0": "-1", "in [0, 1)": "1.5", "above 0": "0"}
# Range rules on flags Megatron-LM's pretrain_gpt.py does not have (metp train's own).
_NOT_MEGATRON = {"--nproc-per-node"}
# Flags the unsupported-feature table names, with a value where the flag takes one.
_FEATURE_VALUES = {"--num-experts": ["8"], "--mtp-num-layers": ["1"],
                   "--experimental-attention-variant": ["gated_delta_net"],
                   "--heterogeneous-layers-config-path": ["layers.json"],
                   "--hierarchical-context-parallel-sizes": ["2", "2"],
                   "--fp8-format": ["hybrid"], "--fp4-format": ["e2m1"]}


def _cases(tmp: Path) -> list:
    """(name, world size, flags, a word the refusal's line must hold), each refused by the
    plugin; ``tmp`` holds the files the path rules look at."""
    (tmp / "a-file").write_text("")
    out = []
    for attr, flag, (_, must), _meaning in validation._VALUE_RULES:
        if flag not in _NOT_MEGATRON:
            out.append((f"range {flag}", 1, BASE + [flag, _BAD[must]], flag))
    for mode, table in (("metp", validation._UNSUPPORTED["metp"]),
                        ("wallfacer", validation._UNSUPPORTED["wallfacer"])):
        sizes, world = (METP, 2) if mode == "metp" else (WALL, 4)
        for _attr, flag, _why in table:
            out.append((f"{mode} {flag}", world, BASE + sizes + [flag] + _FEATURE_VALUES.get(
                flag, []), f"{flag} is not supported"))
    a_file = str(tmp / "a-file")
    out += [
        ("min-lr above lr", 1, BASE + ["--lr", "1e-4", "--min-lr", "1e-3"], "--min-lr"),
        ("recompute modules", 1, BASE + ["--recompute-modules", "core_attn"],
         "--recompute-modules"),
        ("recompute method", 1, BASE + ["--recompute-method", "uniform"], "--recompute-method"),
        ("recompute layers", 1, BASE + ["--recompute-granularity", "full", "--recompute-method",
                                        "uniform", "--recompute-num-layers", "3"],
         "--recompute-num-layers"),
        ("positions", 1, BASE + ["--seq-length", "128"], "--max-position-embeddings"),
        ("save is a file", 1, BASE + ["--save", a_file], "--save"),
        ("save under a file", 1, BASE + ["--save", a_file + "/ckpt"], "--save"),
        ("save unwritable", 1, BASE + ["--save", "/proc/metp-checkpoints"], "--save"),
        ("load is a file", 1, BASE + ["--load", a_file], "--load"),
        ("data path", 1, BASE + ["--data-path", str(tmp / "no-such-prefix")], "--data-path"),
        ("mode", 1, BASE + ["--tensor-parallel-mode", "ring"], "--tensor-parallel-mode"),
        ("world", 3, BASE + TP2, "world size 3"),
        ("pipeline layers", 3, BASE + ["--num-layers", "4", "--pipeline-model-parallel-size",
                                       "3"], "--num-layers 4"),
        ("layers per virtual stage", 2, BASE + ["--num-layers", "4",
                                                "--pipeline-model-parallel-size", "2",
                                                "--num-layers-per-virtual-pipeline-stage", "3"],
         "--num-layers-per-virtual-pipeline-stage"),
        ("virtual stages", 2, BASE + ["--num-layers", "6", "--pipeline-model-parallel-size",
                                      "2", "--num-virtual-stages-per-pipeline-rank", "2"],
         "--num-virtual-stages-per-pipeline-rank"),
        ("virtual pipeline depth", 1, BASE + ["--num-layers", "4",
                                              "--num-virtual-stages-per-pipeline-rank", "2"],
         "--pipeline-model-parallel-size >= 2"),
        ("heads divide hidden", 1, BASE + ["--hidden-size", "66"], "--hidden-size 66"),
        ("groups divide heads", 1, BASE + ["--group-query-attention", "--num-query-groups", "3"],
         "--num-query-groups 3"),
        ("warm-up", 1, BASE + ["--train-iters", "10", "--lr-warmup-iters", "10"],
         "--lr-warmup-iters"),
        ("global batch", 2, BASE + ["--global-batch-size", "3"], "--global-batch-size 3"),
        ("metp cuda graph impl", 2, BASE + METP + ["--cuda-graph-impl", "local"],
         "--cuda-graph-impl local"),
        ("team size outside wallfacer", 2, BASE + METP + ["--wallfacer-team-size", "2"],
         "--wallfacer-team-size 2"),
        ("spec", 2, BASE + METP + ["--spec", "my.module", "my_spec"], "--spec"),
        ("wallfacer comm type outside wallfacer", 2, BASE + ["--context-parallel-size", "2",
                                                             "--cp-comm-type", "wallfacer"],
         "--cp-comm-type wallfacer"),
        ("flash-attn", 1, BASE + ["--use-flash-attn"], "--use-flash-attn"),
        ("tp heads", 3, BASE + ["--tensor-model-parallel-size", "3"],
         "--num-attention-heads 4"),
        ("tp groups", 4, BASE + ["--num-attention-heads", "12", "--group-query-attention",
                                 "--num-query-groups", "6", "--tensor-model-parallel-size", "4",
                                 "--hidden-size", "96", "--ffn-hidden-size", "256"],
         "--num-query-groups 6"),
        ("tp ffn", 2, BASE + TP2 + ["--ffn-hidden-size", "33"], "--ffn-hidden-size 33"),
        ("cp sequence", 2, BASE + ["--context-parallel-size", "2", "--seq-length", "62",
                                   "--max-position-embeddings", "64"], "--seq-length 62"),
        ("sp sequence", 2, BASE + TP2 + ["--sequence-parallel", "--seq-length", "63"],
         "--seq-length 63"),
        ("metp_mlp cp", 4, BASE + ["--tensor-parallel-mode", "metp_mlp",
                                   "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                   "--context-parallel-size", "2"], "metp_mlp"),
        ("metp a2a under cp", 4, BASE + METP + ["--context-parallel-size", "2",
                                                "--metp-ring-pass", "a2a"], "--metp-ring-pass"),
        ("metp cp comm type", 4, BASE + METP + ["--context-parallel-size", "2",
                                                "--cp-comm-type", "a2a"], "--cp-comm-type a2a"),
        ("metp sequence parallel", 2, BASE + ["--tensor-parallel-mode", "metp",
                                              "--tensor-model-parallel-size", "2"],
         "--sequence-parallel"),
        ("metp ffn", 2, BASE + METP + ["--ffn-hidden-size", "33"], "--ffn-hidden-size 33"),
        ("metp hidden", 2, BASE + METP + ["--hidden-size", "65", "--kv-channels", "16"],
         "--hidden-size 65"),
        ("metp sequence", 2, BASE + METP + ["--seq-length", "63"], "--seq-length 63"),
        ("metp heads", 2, BASE + METP + ["--num-attention-heads", "2", "--hidden-size", "64",
                                         "--group-query-attention", "--num-query-groups", "1",
                                         "--num-attention-heads", "1", "--kv-channels", "64"],
         "--num-attention-heads"),
        ("metp groups", 2, BASE + METP + ["--group-query-attention", "--num-query-groups", "1"],
         "--num-query-groups"),
        ("metp odd tp under cp", 6, BASE + ["--tensor-parallel-mode", "metp",
                                            "--tensor-model-parallel-size", "3",
                                            "--sequence-parallel", "--num-attention-heads", "3",
                                            "--hidden-size", "48", "--ffn-hidden-size", "96",
                                            "--context-parallel-size", "2", "--seq-length", "60",
                                            "--max-position-embeddings", "64"],
         "even --tensor-model-parallel-size"),
        ("metp attention dropout", 2, BASE + METP + ["--attention-dropout", "0.1"],
         "--attention-dropout 0.1"),
        ("metp attention dropout by default", 2,
         [t for t in BASE if t not in ("--attention-dropout", "0")] + METP,
         "--attention-dropout 0.1"),
        ("metp output gate", 2, BASE + METP + ["--attention-output-gate"],
         "--attention-output-gate"),
        ("metp softmax", 2, BASE + METP + ["--softmax-type", "off-by-one"], "--softmax-type"),
        ("metp window", 2, BASE + METP + ["--window-size", "(8,0)"], "--window-size"),
        ("metp cp sequence", 8, BASE + METP + ["--tensor-model-parallel-size", "4",
                                               "--context-parallel-size", "2", "--seq-length",
                                               "68", "--max-position-embeddings", "128"],
         "--seq-length 68"),
        ("wallfacer cp comm types", 4, BASE + WALL + ["--cp-comm-type", "wallfacer", "p2p"],
         "--cp-comm-type"),
        ("wallfacer cp comm type", 4, BASE + WALL + ["--cp-comm-type", "a2a"], "--cp-comm-type"),
        ("wallfacer placement", 4, BASE + WALL + ["--wallfacer-placement", "rings"],
         "--wallfacer-placement"),
        ("wallfacer attention dropout by default", 4,
         [t for t in BASE if t not in ("--attention-dropout", "0")] + WALL,
         "--attention-dropout 0.1"),
        ("wallfacer softmax", 4, BASE + WALL + ["--softmax-type", "off-by-one"],
         "--softmax-type"),
        ("wallfacer tp heads", 12, BASE + WALL + ["--context-parallel-size", "4",
                                                 "--tensor-model-parallel-size", "3",
                                                 "--num-attention-heads", "4"],
         "--num-attention-heads 4"),
        ("wallfacer tp ffn", 8, BASE + WALL + ["--context-parallel-size", "4",
                                               "--tensor-model-parallel-size", "2",
                                               "--ffn-hidden-size", "33"],
         "--ffn-hidden-size 33"),
        ("wallfacer team", 4, BASE + WALL + ["--wallfacer-team-size", "3"],
         "--wallfacer-team-size 3"),
        ("wallfacer sequence", 4, BASE + WALL + ["--seq-length", "60",
                                                 "--max-position-embeddings", "64"],
         "--seq-length 60"),
        ("wallfacer groups divide heads", 4, BASE + WALL + ["--group-query-attention",
                                                            "--num-query-groups", "3"],
         "--num-query-groups 3"),
        ("wallfacer groups and tp", 8, BASE + WALL + ["--context-parallel-size", "4",
                                                      "--tensor-model-parallel-size", "2",
                                                      "--group-query-attention",
                                                      "--num-query-groups", "1"],
         "--num-query-groups 1"),
        ("wallfacer sp sequence", 8, BASE + WALL + ["--context-parallel-size", "2",
                                                    "--tensor-model-parallel-size", "4",
                                                    "--sequence-parallel", "--seq-length", "4",
                                                    "--max-position-embeddings", "64"],
         "--seq-length 4"),
        ("wallfacer world", 2, BASE + WALL, "--tensor-model-parallel-size 4"),
    ]
    return out


# Refusals no launch flags can reach, each with the reason (the walk checks this list is
# exact: every other refusal site is reached by a case above).
_UNREACHABLE = {
    "validation.py:team_size:": "Megatron-LM's parser and check_launch refuse a non-integer "
                                "--wallfacer-team-size first",
    "validation.py:check_values:--train-iters 0": "metp train's own rule (trainer=True)",
    "validation.py:check_output_file:": "metp train's --log-json and metp plan's reports",
    "validation.py:_validate:{flag} {v!r}: parallel sizes": "Megatron-LM's parser takes "
                                                            "integers only; a size < 1 fails "
                                                            "the range rule first",
    "validation.py:_check_wallfacer:--cp-comm-type": "the WallFacer remap refuses any given "
                                                     "type but wallfacer first",
    "config_generator.py:validate_wallfacer:--context-parallel-size must": "a CP size < 1 "
                                                                           "fails the range "
                                                                           "rule first",
    "config_generator.py:validate_wallfacer:--wallfacer-team-size must": "team_size() gives "
                                                                          "an int or auto",
    "config_generator.py:check_placement:": "validation checks the placement name first",
    "config_generator.py:validate_wallfacer:--cp-comm-type": "the remap's own rule first",
    "attention_plan.py:check_metp_attention_config:--tensor-parallel-mode metp does not "
    "support --multi-latent-attention": "the unsupported-feature table first",
    "config_generator.py:validate_wallfacer:--num-query-groups {num_query_groups} must "
    "divide": "validation's model-shape rule first",
    "attention_plan.py:check_metp_attention_config:--metp-ring-pass": "validation's own a2a "
                                                                      "rule first",
    "attention_plan.py:check_metp_attention_config:--tensor-parallel-mode metp needs --sequ":
        "validate_metp_mlp's sequence-parallel rule runs first",
}

# The functions whose refusals are walked: (file, function).
_RULE_FUNCTIONS = [
    ("megatron_metp/validation.py", None),
    ("megatron_metp/metp/mlp.py", "validate_metp_mlp"),
    ("megatron_metp/metp/attention_plan.py", "check_metp_attention_config"),
    ("megatron_metp/wallfacer/config_generator.py", "validate_wallfacer"),
    ("megatron_metp/wallfacer/config_generator.py", "check_team_size"),
    ("megatron_metp/wallfacer/config_generator.py", "check_placement"),
]


def _message_words(src: str, node: ast.AST) -> str:
    """A refusal's message as written in the source (its label)."""
    call = node.value if isinstance(node, ast.Expr) else node.exc
    arg = call.args[0] if isinstance(call, ast.Call) and call.args else call
    text = ast.get_source_segment(src, arg) if arg is not None else "raise"
    return " ".join(text.lstrip("f").strip("\"'").split())


def _sites() -> dict:
    """Every refusal site of the walked functions: ``file:function:message`` -> (path, line)."""
    out = {}
    for rel, only in _RULE_FUNCTIONS:
        path = ROOT / rel
        src = path.read_text()
        for fn in ast.walk(ast.parse(src)):
            if not isinstance(fn, ast.FunctionDef) or (only and fn.name != only):
                continue
            for n in ast.walk(fn):
                fail = (isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
                        and getattr(n.value.func, "id", None) == "_fail")
                if fail or isinstance(n, ast.Raise):
                    label = f"{path.name}:{fn.name}:{_message_words(src, n)}"
                    assert label not in out, f"two refusals read the same: {label}"
                    out[label] = (str(path), n.lineno)
    return out


def _line_tracer(files: set, hits: set):
    def local(frame, event, arg):
        if event == "line":
            hits.add((frame.f_code.co_filename, frame.f_lineno))
        return local

    return lambda frame, event, arg: local if frame.f_code.co_filename in files else None


def _launch(world: int, flags: list) -> tuple:
    """The plugin's torchrun on ``flags`` for ``world`` ranks: (exit code, what it printed)."""
    err = io.StringIO()
    with redirect_stderr(err):
        rc = mlm.torchrun(["--nproc-per-node", str(world), "pretrain_gpt.py", *flags])
    return rc, err.getvalue()


def _refused_line(name: str, rc: int, err: str, word: str) -> str:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, (name, rc, err)
    assert lines[0].startswith("megatron-metp: error: ") and word in lines[0], (name, err)
    return lines[0][len("megatron-metp: error: "):]


def test_every_refusal_site_is_walked(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail(f"torchrun would start: {a}"))
    sites = _sites()
    hits: set = set()
    tracer = _line_tracer({p for p, _ in sites.values()}, hits)
    wrong = []
    for name, world, flags, word in _cases(tmp_path):
        sys.settrace(tracer)
        try:
            rc, err = _launch(world, flags)
        except pytest.fail.Exception:
            rc, err = None, "not refused: torchrun would start"
        finally:
            sys.settrace(None)
        try:
            _refused_line(name, rc, err, word)
        except AssertionError as e:
            wrong.append(str(e))
    assert not wrong, "\n".join(wrong)
    unreached = {label for label, site in sites.items() if site not in hits}
    exempt = {label for label in unreached if any(label.startswith(k) for k in _UNREACHABLE)}
    assert not unreached - exempt, "\n".join(sorted(unreached - exempt))
    # Each exemption names a site that is still there and still unreached.
    stale = [k for k in _UNREACHABLE if not any(label.startswith(k) for label in unreached)]
    assert not stale, stale
    assert len(sites) - len(unreached) >= 50   # the walk found the sites it reached


_RANKS = r"""
import io, json, os, sys, warnings
from contextlib import redirect_stderr, redirect_stdout
warnings.filterwarnings("ignore")
import megatron.training.arguments as A
from megatron_metp import megatron_lm as mlm
out = []
for world, flags in json.load(sys.stdin):
    os.environ["WORLD_SIZE"] = str(world)
    sys.argv = ["pretrain_gpt.py"] + flags
    noise = io.StringIO()
    try:
        with redirect_stdout(noise), redirect_stderr(noise):
            args = A.parse_args(extra_args_provider=mlm.extra_args_provider)
            mlm.remap_and_validate(args, flags)
        out.append(None)
    except mlm.MetpConfigError as e:
        out.append(str(e))
    except SystemExit:
        out.append("Megatron-LM's parser: " + noise.getvalue().strip().splitlines()[-1])
print("RESULT " + json.dumps(out))
"""


@pytest.mark.full
@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_PATH"),
                    reason="set MEGATRON_LM_PATH to a Megatron-LM core_v0.16.1 checkout: the "
                           "ranks' side is its parse_args")
def test_the_ranks_refuse_what_the_launcher_refuses(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail(f"torchrun would start: {a}"))
    cases = _cases(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.environ["MEGATRON_LM_PATH"], str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _RANKS], input=json.dumps(
        [(world, flags) for _, world, flags, _ in cases]), env=env, capture_output=True,
        text=True, timeout=600, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    differ = []
    for (name, world, flags, word), rank_line in zip(cases, ranks):
        launcher_line = _refused_line(name, *_launch(world, flags), word)
        # Megatron-LM's parser refusing a value (a flag's choices) stops the ranks too, before
        # the plugin's check: then the launcher's own line is the one the user sees.
        parser = rank_line is not None and rank_line.startswith("Megatron-LM's parser: ")
        if rank_line != launcher_line and not parser:
            differ.append((name, rank_line, launcher_line))
    assert not differ, "\n".join(f"{n}: ranks {r!r} | launcher {l!r}" for n, r, l in differ)
