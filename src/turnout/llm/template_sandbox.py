"""Bounded rendering of untrusted Jinja templates: a budget a template spends as it runs.

A chat template comes from a model card, that is from whoever can write the discovery store.
jinja2's sandbox keeps it away from Python internals, not from spending: ``range`` stops at
100,000 items, but two nested loops over it spin 10^10 times; ``'x' * 10**10`` allocates
10 GB; ``'x'|center(10**9)`` a gigabyte; a macro that calls itself twice doubles each level.
Any of these would hold the event loop (or a worker thread) for as long as it likes.

Mental model: a render carries a ``RenderBudget`` (set for the render's duration in a
context variable, so concurrent renders in threads each see their own) and the template pays
as it runs, in three currencies:

* **operations**: every loop iteration, call, attribute or item access, filter and
  membership test costs one (a macro call ten); a slice, a filter over a container or ``in``
  over a string costs in proportion to what it walks. Counting is deterministic, so a
  template that passes once passes always, whatever the machine's load;
* **characters built**: every string the template makes (operators, ``~``, filters, method
  calls, output) counts its length against an allowance, which bounds what a render can
  allocate in all, retained or not;
* **one value's size**: nothing the template builds may exceed ``max_value_chars``, checked
  *before* it is built wherever its size can be known in advance (repetition,
  concatenation, padding, replacement, joins, format widths, powers), so the allocation
  never happens; after otherwise. The output as a whole is held to the same bound by the
  caller, as it is written (``chat_template``).

A wall-clock deadline, read every ``_CLOCK_EVERY`` operations, backs the count up against a
single operation that is slow for its size (comparing two long strings, say).

Whatever is exceeded raises ``TemplateLimitExceeded`` from inside the template: the render
stops where it is, with nothing left running (a Python thread cannot be killed, so a
time limit enforced from outside could not do that).

How the hooks reach every operation: the sandbox already routes attribute and item access,
calls and the binary operators it intercepts through the environment; the code generator
here routes the rest (loop iterables, ``~``, slices, ``in``) through it too; filters are
wrapped one by one. Templates compiled without a budget (constant folding at compile time)
pay nothing, but the size checks still apply.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import string
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import Context, LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg

from turnout.errors import TemplateLimitExceeded

__all__ = [
    "BoundedEnvironment",
    "RenderBudget",
    "bounded_strftime",
    "make_environment",
    "rendering",
    "weight",
]

#: Operations between two reads of the clock (a read costs about as much as an operation).
_CLOCK_EVERY = 256
#: A power's result, in bits: 2**65536 is already a 19,729-digit number.
_MAX_INT_BITS = 1 << 16
#: The longest ``strftime_now`` format (real templates pass "%d %b %Y").
_MAX_STRFTIME_CHARS = 256
#: Widest ``tojson(indent=...)``.
_MAX_JSON_INDENT = 64
#: Operations a macro call costs (it sets up a frame: about ten attribute accesses' time).
_MACRO_OPS = 10
#: Operations a membership test or a string filter costs per this many characters walked.
_CHARS_PER_OP = 256


@dataclass(slots=True)
class RenderBudget:
    """What one render may spend; the counters (``ops``, ``chars``) are spent by the hooks of
    ``BoundedEnvironment`` only, from the render's own thread.

    The hot path of every hook is ``ops -= n`` and one comparison with ``checkpoint``; the
    rest (the budget's end, the clock) is looked at in ``settle``, every ``_CLOCK_EVERY``
    operations::

        ops:  budget ....... checkpoint ....... checkpoint ....... 0 (exceeded)
                    settle() ^          settle() ^
    """

    #: Operations left (loop iterations, calls, attribute and item accesses, filters, ...).
    ops: int
    #: Characters the render may still build, in all (intermediate strings included).
    chars: int
    #: The longest string, or heaviest list, the template may build; and its output's length.
    max_value_chars: int
    #: ``time.monotonic()`` past which the render stops.
    deadline: float
    #: ``ops`` at which ``settle`` next runs.
    checkpoint: int = 0
    #: Weights of the containers the template built (id -> (container, weight)): lists are
    #: immutable in the sandbox, so a weight computed once holds, and ``ns.items + [x]`` in a
    #: loop costs its new part only. The container is held so its id is not reused.
    weights: dict[int, tuple[object, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.checkpoint = max(self.ops - _CLOCK_EVERY, 0)

    def spend(self, n: int = 1) -> None:
        self.ops -= n
        if self.ops < self.checkpoint:
            self.settle()

    def settle(self) -> None:
        """Past a checkpoint: stop the render if its operations or its time are spent."""
        if self.ops < 0:
            raise TemplateLimitExceeded(
                "the chat template ran past its operation budget (a loop or recursion "
                "that does not end, or grows with the input faster than it may)"
            )
        if time.monotonic() > self.deadline:
            raise TemplateLimitExceeded("the chat template ran past its time budget")
        self.checkpoint = max(self.ops - _CLOCK_EVERY, 0)

    def build(self, size: int, what: str = "a value") -> None:
        """Account for a string (or container) of ``size`` characters about to be built."""
        if size > self.max_value_chars:
            raise TemplateLimitExceeded(
                f"the chat template builds {what} of {size} characters; at most "
                f"{self.max_value_chars} are allowed"
            )
        self.chars -= size
        if self.chars < 0:
            raise TemplateLimitExceeded(
                "the chat template built more text than its budget allows (it grows a "
                "value in a loop?)"
            )


_BUDGET: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar(
    "turnout_template_budget", default=None
)


@contextlib.contextmanager
def rendering(budget: RenderBudget) -> Iterator[RenderBudget]:
    """Make ``budget`` the current render's budget for the ``with`` block."""
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


def _spend(n: int = 1) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.spend(n)


def _size(value: object) -> int | None:
    """``len(value)`` for a sized value, else None (no ABC check: it is on the hot path)."""
    return len(value) if hasattr(type(value), "__len__") else None  # type: ignore[arg-type]


def _refuse(what: str, size: int, limit: int) -> TemplateLimitExceeded:
    return TemplateLimitExceeded(
        f"the chat template builds {what} of {size} characters; at most {limit} are allowed"
    )


def _check_size(size: int, what: str = "a value") -> None:
    """Refuse a value of ``size`` before it is built; with a budget, also count it."""
    budget = _BUDGET.get()
    if budget is not None:
        budget.build(size, what)
    elif size > _COMPILE_TIME_MAX_CHARS:
        raise _refuse(what, size, _COMPILE_TIME_MAX_CHARS)


#: Size bound when there is no render (constant folding while compiling): constants a
#: template spells out are small; anything bigger is left for the render to compute and
#: check against its own bound.
_COMPILE_TIME_MAX_CHARS = 1 << 16


def _limit() -> int:
    budget = _BUDGET.get()
    return budget.max_value_chars if budget is not None else _COMPILE_TIME_MAX_CHARS


# -- sizes ---------------------------------------------------------------------------------------


_CONTAINERS = frozenset({list, tuple, dict, set, frozenset, range})


def weight(value: object, limit: int, indent: int = 0) -> int:
    """About how many characters ``str(value)`` (or its JSON) takes, walking containers (an
    operation an item, charged), stopping once past ``limit``. ``indent``: of JSON written
    with that indent, each item on a line of its own behind its depth's indentation."""
    if isinstance(value, str):  # Markup (from the escape filter) included
        return len(value)
    if type(value) not in _CONTAINERS:
        value = _as_container(value)
        if value is None:
            return 8
    budget = _BUDGET.get()
    if budget is not None and not indent:
        known = budget.weights.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
    if not indent:
        return _flat_weight(value, limit, budget)
    total = 0
    walked = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack and total <= limit:
        item, depth = stack.pop()
        walked += 1
        kind = type(item)
        pad = depth * indent
        if kind is str:
            total += len(item) + 4 + pad  # type: ignore[arg-type]
        elif kind is dict:
            total += 2 + pad
            for key, val in item.items():  # type: ignore[attr-defined]
                stack.append((key, depth + 1))
                stack.append((val, depth + 1))
        elif kind is list or kind is tuple or kind is set or kind is frozenset:
            total += 2 + pad
            stack.extend((x, depth + 1) for x in item)  # type: ignore[attr-defined]
        elif kind is range:
            total += 2 + (8 + pad) * len(item)  # type: ignore[arg-type]
        else:
            other = _as_container(item)
            if other is None:
                total += 8 + pad
            else:
                stack.append((other, depth))
    if budget is not None:
        budget.spend(walked)
    return total


def _as_container(value: object) -> Any:
    """What a subclass of a built-in container or of ``str`` weighs as (a ``Markup``, an
    ``OrderedDict``, a named tuple), or None for anything else (a number, an object)."""
    if isinstance(value, str):
        return str(value)
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    return None


def _flat_weight(value: object, limit: int, budget: RenderBudget | None) -> int:
    """``weight`` without indentation (the common case, walked without depths)."""
    total = 0
    walked = 0
    stack: list[Any] = [value]
    pop, push, extend = stack.pop, stack.append, stack.extend
    while stack and total <= limit:
        item = pop()
        walked += 1
        kind = type(item)
        if kind is str:
            total += len(item) + 4
        elif kind is dict:
            total += 2
            for key, val in item.items():
                push(key)
                push(val)
        elif kind is list or kind is tuple or kind is set or kind is frozenset:
            total += 2
            extend(item)
        elif kind is range:
            total += 2 + 8 * len(item)
        else:
            other = _as_container(item)
            if other is None:
                total += 8
            else:
                push(other)
    if budget is not None:
        budget.spend(walked)
    return total


def _remember(value: object, size: int) -> None:
    budget = _BUDGET.get()
    if budget is not None and isinstance(value, (list, tuple, dict)):
        budget.weights[id(value)] = (value, size)


# Conversion specifiers of printf-style formats, and the numbers in a ``str.format`` spec.
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


def _check_int_args(args: Iterable[object], what: str) -> None:
    limit = _limit()
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > limit:
            raise _refuse(what, abs(arg), limit)


def _check_percent_format(fmt: str, args: object) -> None:
    """``fmt % args`` would not build a value past the bound: no width or precision in
    ``fmt`` above it, nor any ``*`` taken from ``args`` (checked before formatting)."""
    limit = _limit()
    star = False
    for match in _PERCENT_SPEC.finditer(fmt):
        for group in match.groups():
            if group == "*":
                star = True
            elif group is not None and int(group) > limit:
                raise _refuse("a formatted field", int(group), limit)
    if star:
        _check_int_args(args if isinstance(args, tuple) else (args,), "a formatted field")


def _check_brace_format(fmt: str, args: Iterable[object]) -> None:
    """The same for ``str.format``: the numbers of every field's spec, and the arguments
    when a spec takes its width from them."""
    limit = _limit()
    nested = False
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if not spec:
            continue
        if "{" in spec:
            nested = True
        for digits in _DIGITS.findall(spec):
            if int(digits) > limit:
                raise _refuse("a formatted field", int(digits), limit)
    if nested:
        _check_int_args(args, "a formatted field")


def _replace_size(s: str, old: str, new: str, count: int = -1) -> int:
    hits = len(s) + 1 if old == "" else s.count(old)
    if count is not None and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * (len(new) - len(old))


def _join_size(sep: object, items: object) -> int:
    limit = _limit()
    n = _size(items) or 0
    return len(str(sep)) * max(n - 1, 0) + weight(items, limit)


# -- str methods the template may call ------------------------------------------------------------


def _check_str_method(name: str, s: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a ``str`` method call whose result would pass the bound, before it runs."""
    if name in ("ljust", "rjust", "center", "zfill"):
        width = args[0] if args else kwargs.get("width", 0)
        if isinstance(width, int):
            _check_size(max(width, len(s)), f"a padded string ({name})")
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            _check_size(len(s) + s.count("\t") * max(size, 0), "an expanded string")
    elif name == "replace" and len(args) >= 2:
        old, new = args[0], args[1]
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        if isinstance(old, str) and isinstance(new, str) and isinstance(count, int):
            _check_size(_replace_size(s, old, new, count), "a replaced string")
    elif name == "join" and args:
        _check_size(_join_size(s, args[0]), "a joined string")


# -- filters --------------------------------------------------------------------------------------


def _check_center(value: object, width: int = 80) -> None:
    if isinstance(width, int):
        _check_size(max(width, 0), "a centred string")


def _check_indent(
    s: object, width: int | str = 4, first: bool = False, blank: bool = False
) -> None:
    text = str(s)
    step = len(width) if isinstance(width, str) else max(width, 0)
    _check_size(len(text) + (text.count("\n") + 2) * step, "an indented string")


def _check_wordwrap(
    s: object,
    width: int = 79,
    break_long_words: bool = True,
    wrapstring: str | None = None,
    break_on_hyphens: bool = True,
) -> None:
    text = str(s)
    lines = len(text) // max(width, 1) + text.count("\n") + 1
    _check_size(len(text) + lines * len(wrapstring or "\n"), "a wrapped string")


def _check_replace(s: object, old: object, new: object, count: int | None = None) -> None:
    _check_size(
        _replace_size(str(s), str(old), str(new), -1 if count is None else count),
        "a replaced string",
    )


def _check_join(value: object, d: str = "", attribute: object = None) -> None:
    _check_size(_join_size(d, value), "a joined string")


def _check_format(value: object, *args: object, **kwargs: object) -> None:
    if isinstance(value, str):
        _check_percent_format(value, kwargs if kwargs else args)


def _check_batch(value: object, linecount: int, fill_with: object = None) -> None:
    _check_int_args((linecount,), "a batch")


def _check_slice(value: object, slices: int, fill_with: object = None) -> None:
    _check_int_args((slices,), "a slice count")


def _check_sum(iterable: object, attribute: object = None, start: object = 0) -> None:
    if not isinstance(start, (int, float)):
        # Summing lists or strings is quadratic, and no template needs it.
        raise TemplateLimitExceeded("the chat template sums non-numbers (sum's 'start')")


def _check_stringify(value: object, *args: object, **kwargs: object) -> None:
    if not isinstance(value, str):
        _check_size(weight(value, _limit()), "a value's text")


def _check_tojson(value: object, ensure_ascii: bool = False, indent: object = None,
                  separators: object = None, sort_keys: bool = False) -> None:  # fmt: skip
    step = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
    if step > _MAX_JSON_INDENT:
        raise _refuse("a JSON indent", step, _MAX_JSON_INDENT)
    if step:  # indentation grows with depth: size it first
        _check_size(weight(value, _limit(), indent=step), "a JSON text")
    # Without, JSON is about as long as the value's text, which was sized when it was built
    # (or came with the request): its length is checked once written.


def _check_list(value: object) -> None:
    if isinstance(value, str):
        _check_size(len(value) * 8, "a list of characters")


#: Pre-checks of the filters whose result can outgrow their input, called with the filter's
#: own arguments (the value first) before it runs.
_FILTER_CHECKS: dict[str, Callable[..., None]] = {
    "center": _check_center,
    "indent": _check_indent,
    "wordwrap": _check_wordwrap,
    "replace": _check_replace,
    "join": _check_join,
    "format": _check_format,
    "batch": _check_batch,
    "slice": _check_slice,
    "sum": _check_sum,
    "string": _check_stringify,
    "pprint": _check_stringify,
    "urlencode": _check_stringify,
    "tojson": _check_tojson,
    "list": _check_list,
}


def _counted(items: Iterable[Any]) -> Iterator[Any]:
    for item in items:
        _spend()
        yield item


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` paying for itself: one operation, plus one an item of a container it is given
    (sorting, grouping, selecting walk them all) or per ``_CHARS_PER_OP`` characters of a
    string; its pre-check, if any; its string result counted as built; a lazy result paying
    as it is consumed."""
    skip = 1 if _PassArg.from_obj(func) is not None else 0
    check = _FILTER_CHECKS.get(name)

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        if len(args) > skip and budget is not None:
            value = args[skip]
            if type(value) is str:
                budget.spend(1 + len(value) // _CHARS_PER_OP)
            else:
                budget.spend(1 + (_size(value) or 0))
        if check is not None:
            check(*args[skip:], **kwargs)
        result = func(*args, **kwargs)
        if type(result) is str:
            _check_size(len(result), f"the result of filter {name!r}")
        elif budget is not None and hasattr(type(result), "__next__"):
            return _counted(result)  # a lazy result (map, select, batch, ...)
        return result

    return bounded


# -- the environment ------------------------------------------------------------------------------


#: The filter every ``{% for %}`` iterable is passed through (a name no template can spell:
#: jinja forbids new node types, so the loop's iterable is wrapped in a filter node).
_ITER_FILTER = "budget iter"


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, routing what the sandbox does not through the environment:
    every ``{% for %}`` iterable, ``~``, slices and single ``in`` / ``not in`` tests."""

    def visit_Template(self, node: nodes.Template, frame: Frame | None = None) -> None:
        # Before the parent pulls the filters a template uses into its namespace.
        for loop in node.find_all(nodes.For):
            wrapped = nodes.Filter(loop.iter, _ITER_FILTER, [], [], None, None)
            wrapped.set_lineno(loop.iter.lineno)
            wrapped.set_environment(self.environment)
            loop.iter = wrapped
        super().visit_Template(node, frame)

    def visit_Add(self, node: nodes.BinExpr, frame: Frame) -> None:
        """``a + b + c + d`` as one call over its operands (``add_chain``): templates build
        each turn with such chains, and one call costs a fifth of four."""
        operands: list[nodes.Expr] = []
        left: nodes.Expr = node
        while isinstance(left, nodes.Add):
            operands.append(left.right)
            left = left.left
        operands.append(left)
        self.write("environment.add_chain((")
        for operand in reversed(operands):
            self.visit(operand, frame)
            self.write(", ")
        self.write("))")

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.concat_checked((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def visit_Getitem(self, node: nodes.Getitem, frame: Frame) -> None:
        if not isinstance(node.arg, nodes.Slice):
            super().visit_Getitem(node, frame)
            return
        self.write("environment.getslice(")
        self.visit(node.node, frame)
        self.write(", ")
        for part in (node.arg.start, node.arg.stop, node.arg.step):
            if part is None:
                self.write("None")
            else:
                self.visit(part, frame)
            self.write(", ")
        self.write(")")

    def visit_Compare(self, node: nodes.Compare, frame: Frame) -> None:
        if len(node.ops) != 1 or node.ops[0].op not in ("in", "notin"):
            super().visit_Compare(node, frame)
            return
        self.write("(not " if node.ops[0].op == "notin" else "(")
        self.write("environment.contains(")
        self.visit(node.expr, frame)
        self.write(", ")
        self.visit(node.ops[0].expr, frame)
        self.write("))")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox whose every operation is paid for from the current
    ``RenderBudget`` (see the module docstring). Set the budget with ``rendering``."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=self._finalize, **options)
        # lipsum writes as much text as it is asked for; no chat template uses it.
        self.globals.pop("lipsum", None)
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters[_ITER_FILTER] = self.budget_iter

    def bound_filter(self, name: str, func: Callable[..., Any]) -> None:
        """Install filter ``name``, paid for like the built-in ones."""
        self.filters[name] = _bounded_filter(name, func)

    # -- what the sandbox routes here -----------------------------------------------------------

    def getattr(self, obj: Any, attribute: str) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            budget.ops -= 1
            if budget.ops < budget.checkpoint:
                budget.settle()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            budget.ops -= 1
            if budget.ops < budget.checkpoint:
                budget.settle()
        return super().getitem(obj, argument)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            if isinstance(__obj, Macro):
                budget.spend(_MACRO_OPS)
            elif isinstance(__obj, LoopContext) and args:
                budget.spend(1 + (_size(args[0]) or 0))  # a recursive loop's next level
            else:
                budget.spend()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            _check_str_method(getattr(__obj, "__name__", ""), owner, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, str) and result is not owner:
            _check_size(len(result), "a method's result")
        return result

    def add_chain(self, operands: tuple[Any, ...]) -> Any:
        """``operands[0] + operands[1] + ...``, left to right; strings (the hot path: turns
        are built so) are sized, then joined at once."""
        size = 0
        for operand in operands:
            if type(operand) is not str:
                break
            size += len(operand)
        else:
            budget = _BUDGET.get()
            if budget is not None:
                budget.spend()
                budget.build(size, "a concatenated string")
            elif size > _COMPILE_TIME_MAX_CHARS:
                raise _refuse("a concatenated string", size, _COMPILE_TIME_MAX_CHARS)
            return "".join(operands)
        result = operands[0]
        for operand in operands[1:]:
            result = self.call_binop(None, "+", result, operand)  # type: ignore[arg-type]
        return result

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        _spend()
        limit = _limit()
        if operator == "*":
            seq, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                size = weight(seq, limit) * max(times, 0)
                _check_size(size, "a repeated value")
                result = seq * times
                _remember(result, size)
                return result
            if (
                isinstance(left, int)
                and isinstance(right, int)
                and left.bit_length() + right.bit_length() > _MAX_INT_BITS
            ):
                raise TemplateLimitExceeded("the chat template builds a number too large")
        elif operator == "**":
            if (
                isinstance(left, int)
                and isinstance(right, int)
                and right > 0
                and abs(left) > 1
                and left.bit_length() * right > _MAX_INT_BITS
            ):
                raise TemplateLimitExceeded("the chat template builds a number too large")
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                size = weight(left, limit) + weight(right, limit)
                _check_size(size, "a concatenated value")
                # Python's own ``+``: mixed kinds (a str and a list) fail as they would there.
                result = self.binop_table["+"](left, right)
                _remember(result, size)
                return result
        elif operator == "%" and isinstance(left, str):
            _check_percent_format(left, right)
            result = left % right
            _check_size(len(result), "a formatted string")
            return result
        return self.binop_table[operator](left, right)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """``str.format`` / ``format_map``, width-checked before they run."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt: str = value.__self__

        def bounded(*args: Any, **kwargs: Any) -> str:
            _spend()
            values = list(args) + list(kwargs.values())
            if args and isinstance(args[0], dict) and value.__name__ == "format_map":
                values = list(args[0].values())
            _check_brace_format(fmt, values)
            result = wrapped(*args, **kwargs)
            _check_size(len(result), "a formatted string")
            return result

        return bounded

    # -- what the code generator routes here ----------------------------------------------------

    def budget_iter(self, iterable: Any) -> Any:
        """A loop's iterable: a sized one is paid for whole, up front (and iterated as it is,
        so ``loop.length`` stays cheap); any other item by item."""
        budget = _BUDGET.get()
        if budget is None:
            return iterable
        size = _size(iterable)
        if size is not None:
            budget.spend(1 + size)
            return iterable
        return _counted(iterable)

    def concat_checked(self, parts: tuple[Any, ...]) -> str:
        """``a ~ b ~ c``, its length checked before it is joined."""
        texts = [p if isinstance(p, str) else self._text(p) for p in parts]
        _spend()
        _check_size(sum(map(len, texts)), "a concatenated string")
        return "".join(texts)

    def getslice(self, obj: Any, start: Any, stop: Any, step: Any) -> Any:
        result = obj[start:stop:step]
        size = _size(result) or 0
        _spend(1 + (size // _CHARS_PER_OP if type(result) is str else size))
        return result

    def contains(self, item: Any, container: Any) -> bool:
        """``item in container``, paid for by what it walks."""
        if isinstance(container, str):
            _spend(1 + len(container) // _CHARS_PER_OP)
        elif isinstance(container, (list, tuple)):
            _spend(1 + len(container))
        else:
            _spend()
        return item in container

    def _text(self, value: Any) -> str:
        if not isinstance(value, (str, int, float, bool)) and value is not None:
            _check_size(weight(value, _limit()), "a value's text")
        return str(value)

    def _finalize(self, value: Any) -> Any:
        """What ``{{ value }}`` writes: a container's text is sized before ``str`` makes it."""
        if isinstance(value, (list, tuple, dict, set, frozenset)):
            _check_size(weight(value, _limit()), "a value's text")
        return value


def bounded_strftime(strftime: Callable[[str], str]) -> Callable[[str], str]:
    """``strftime_now`` with a short format only (each directive can write many times its
    own length)."""

    @functools.wraps(strftime)
    def bounded(fmt: str) -> str:
        _spend()
        if len(fmt) > _MAX_STRFTIME_CHARS:
            raise _refuse("a strftime format", len(fmt), _MAX_STRFTIME_CHARS)
        return strftime(fmt)

    return bounded


def make_environment(**options: Any) -> BoundedEnvironment:
    """A ``BoundedEnvironment`` with the ``loopcontrols`` extension (what HF templates use)."""
    return BoundedEnvironment(extensions=[jinja2.ext.loopcontrols], **options)
