"""Mutation testing over ``src/turnout/router/`` and ``src/turnout/llm/``: do the tests notice?

Each mutant is one small change to one function, made with ``ast`` (no extra dependency):
a comparison flipped (``<`` → ``>=``, ``==`` → ``!=``, ``in`` → ``not in``, ...), an arithmetic
operator swapped (``+`` ↔ ``-``, ``*`` ↔ ``/``), a boolean constant negated, ``and`` ↔ ``or``,
or a statement dropped (replaced by ``pass``). A random sample (``--seed``, ``--max-mutants``)
is run, one mutant at a time, against the tests that mirror the mutated module (``tests/router``
for ``src/turnout/router/...``, the deepest mirror folder that exists), under a per-mutant
timeout. A mutant is *killed* when the tests fail or time out, *survives* when they pass.

Mutants are applied in a private copy of ``src/`` and ``tests/`` (under ``--workdir``), never in
the working tree, so that other work on the tree is not disturbed. Not part of CI.

    .venv/bin/python benchmarks/mutation.py --max-mutants 60 --seed 1 --timeout 90

writes ``benchmarks/results/mutation.json``: the survival rate overall and per module, and each
surviving mutant as ``file:line`` with the mutation.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("src/turnout/router", "src/turnout/llm")

COMPARE_FLIPS: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.GtE,
    ast.GtE: ast.Lt,
    ast.Gt: ast.LtE,
    ast.LtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
BINOP_SWAPS: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
}
DROPPABLE = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Raise)


@dataclass(frozen=True, slots=True)
class Mutant:
    path: str  # relative to the repository root
    line: int
    function: str
    mutation: str  # what changed, e.g. "a < b -> a >= b"
    # The source segment replaced (1-based lines, byte columns as ``ast`` gives them).
    start: tuple[int, int]
    end: tuple[int, int]
    replacement: str


@dataclass(slots=True)
class Outcome:
    mutant: Mutant
    status: str  # "killed", "survived", "timeout"
    seconds: float


def _segment(node: ast.AST) -> tuple[tuple[int, int], tuple[int, int]]:
    return (node.lineno, node.col_offset), (
        node.end_lineno or node.lineno,
        node.end_col_offset or 0,
    )  # type: ignore[attr-defined]


def _mutants_of_function(path: str, func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[Mutant]:
    out: list[Mutant] = []

    def add(node: ast.AST, mutated: ast.AST | None, what: str) -> None:
        start, end = _segment(node)
        text = "pass" if mutated is None else f"({ast.unparse(mutated)})"
        out.append(Mutant(path, start[0], func.name, what, start, end, text))

    for node in ast.walk(func):
        # Nested functions are mutated as their own functions.
        if node is not func and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                flip = COMPARE_FLIPS.get(type(op))
                if flip is not None:
                    ops = [*node.ops]
                    ops[i] = flip()
                    mutated = ast.Compare(node.left, ops, node.comparators)
                    add(node, mutated, f"{ast.unparse(node)} -> {ast.unparse(mutated)}")
        elif isinstance(node, ast.BinOp) and type(node.op) in BINOP_SWAPS:
            mutated = ast.BinOp(node.left, BINOP_SWAPS[type(node.op)](), node.right)
            add(node, mutated, f"{ast.unparse(node)} -> {ast.unparse(mutated)}")
        elif isinstance(node, ast.BoolOp):
            mutated = ast.BoolOp(
                ast.Or() if isinstance(node.op, ast.And) else ast.And(), node.values
            )
            add(node, mutated, f"{ast.unparse(node)} -> {ast.unparse(mutated)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
            add(node, ast.Constant(not node.value), f"{node.value} -> {not node.value}")
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            add(node, node.operand, f"{ast.unparse(node)} -> {ast.unparse(node.operand)}")
        if isinstance(node, DROPPABLE) and not _is_equivalent_drop(node):
            first = ast.unparse(node).splitlines()[0]
            add(node, None, f"drop `{first[:80]}`")
    return out


def _is_equivalent_drop(node: ast.AST) -> bool:
    """Dropping a docstring, a ``...`` body or a ``return None`` changes nothing worth a run
    (``return None`` mid-function does, but is rare enough to leave out)."""
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        return isinstance(node.value.value, str) or node.value.value is Ellipsis
    if isinstance(node, ast.Return):
        return node.value is None or (
            isinstance(node.value, ast.Constant) and node.value.value is None
        )
    return False


def find_mutants(root: Path, targets: tuple[str, ...]) -> list[Mutant]:
    mutants: list[Mutant] = []
    for target in targets:
        for file in sorted((root / target).rglob("*.py")):
            rel = str(file.relative_to(root))
            tree = ast.parse(file.read_bytes(), filename=rel)
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    mutants.extend(_mutants_of_function(rel, node))
    return mutants


def apply(source: bytes, mutant: Mutant) -> bytes:
    lines = source.splitlines(keepends=True)
    (l0, c0), (l1, c1) = mutant.start, mutant.end
    head = b"".join(lines[: l0 - 1]) + lines[l0 - 1][:c0]
    tail = lines[l1 - 1][c1:] + b"".join(lines[l1:])
    return head + mutant.replacement.encode() + tail


def tests_for(root: Path, path: str) -> str:
    """The deepest ``tests/`` folder that mirrors the module's package."""
    parts = Path(path).relative_to("src/turnout").parent.parts
    for depth in range(len(parts), 0, -1):
        candidate = Path("tests", *parts[:depth])
        if (root / candidate).is_dir():
            return str(candidate)
    return "tests"


def run_tests(work: Path, tests: str, timeout: float, *, show: bool = False) -> str:
    env = {**os.environ, "PYTHONPATH": f"{work / 'src'}{os.pathsep}{work}"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", tests]
    try:
        done = subprocess.run(
            cmd, cwd=work, env=env, timeout=timeout, capture_output=True, check=False
        )
    except subprocess.TimeoutExpired:
        return "timeout"
    if show and done.returncode != 0:
        print(done.stdout.decode()[-3000:], file=sys.stderr)
    return "survived" if done.returncode == 0 else "killed"


def make_workdir(base: Path | None) -> Path:
    work = Path(tempfile.mkdtemp(prefix="turnout-mutation-", dir=base))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "src", work / "src", ignore=ignore)
    shutil.copytree(ROOT / "tests", work / "tests", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", work / "pyproject.toml")
    return work


def summarize(outcomes: list[Outcome], considered: int, args: argparse.Namespace) -> dict:
    per_module: dict[str, dict[str, int]] = defaultdict(lambda: {"run": 0, "survived": 0})
    for o in outcomes:
        row = per_module[o.mutant.path]
        row["run"] += 1
        row["survived"] += o.status == "survived"
    survived = [o for o in outcomes if o.status == "survived"]
    return {
        "targets": list(TARGETS),
        "seed": args.seed,
        "mutants_found": considered,
        "mutants_run": len(outcomes),
        "killed": sum(o.status == "killed" for o in outcomes),
        "timeouts": sum(o.status == "timeout" for o in outcomes),
        "survived": len(survived),
        "survival_rate": round(len(survived) / len(outcomes), 3) if outcomes else None,
        "per_module": {
            path: {**row, "survival_rate": round(row["survived"] / row["run"], 3)}
            for path, row in sorted(per_module.items())
        },
        "surviving_mutants": [
            {
                "where": f"{o.mutant.path}:{o.mutant.line}",
                "function": o.mutant.function,
                "mutation": o.mutant.mutation,
                "tests": tests_for(ROOT, o.mutant.path),
            }
            for o in survived
        ],
        "seconds": round(sum(o.seconds for o in outcomes), 1),
        "command": " ".join(["benchmarks/mutation.py", *sys.argv[1:]]),
    }


def write(out: Path, report: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-mutants", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=90.0, help="seconds per mutant")
    ap.add_argument("--only", default="", help="only files whose path contains this")
    ap.add_argument("--workdir", type=Path, default=None, help="where the private copy goes")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/mutation.json")
    args = ap.parse_args(argv)

    mutants = [m for m in find_mutants(ROOT, TARGETS) if args.only in m.path]
    sample = random.Random(args.seed).sample(mutants, min(args.max_mutants, len(mutants)))
    work = make_workdir(args.workdir)
    outcomes: list[Outcome] = []
    try:
        # Unmutated, every test folder used must pass, or every mutant would look killed.
        for tests in sorted({tests_for(work, m.path) for m in sample}):
            if run_tests(work, tests, args.timeout * 3, show=True) != "survived":
                print(f"baseline: {tests} fails without a mutant", file=sys.stderr)
                return 1
        for i, mutant in enumerate(sample, 1):
            file = work / mutant.path
            original = file.read_bytes()
            mutated = apply(original, mutant)
            try:
                compile(mutated, mutant.path, "exec")
            except SyntaxError:
                continue  # not a valid program: not a mutant
            file.write_bytes(mutated)
            started = time.monotonic()
            try:
                status = run_tests(work, tests_for(work, mutant.path), args.timeout)
            finally:
                file.write_bytes(original)
            outcomes.append(Outcome(mutant, status, time.monotonic() - started))
            write(args.out, summarize(outcomes, len(mutants), args))  # partial results survive
            print(
                f"[{i}/{len(sample)}] {status:8} {mutant.path}:{mutant.line} {mutant.mutation}",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = summarize(outcomes, len(mutants), args)
    write(args.out, report)
    print(json.dumps({k: report[k] for k in ("mutants_run", "survived", "survival_rate")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
