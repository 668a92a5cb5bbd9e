"""What the docs may claim: the checks of tests/test_docs_consistency.py, as functions of the pages' text.

Three rules, each a function that returns the problems it finds (empty: none):

- :func:`figure_problems`: a speed or size ratio quoted in the user-facing pages (README, the
  home page, the guide) is one that ``make bench`` wrote into the results of docs/benchmarks.md,
  which name the commit and the machine of every figure. A quoted figure that is no longer
  measured, or never was, is a problem.
- :func:`status_problems`: what has run on a GPU is said in one place, the status table of the
  README (marked ``status``); a page says it by including that table. A sentence elsewhere that
  says CUDA tests passed or failed, or that the code has or has not run on a GPU, is a problem.
- :func:`launch_problems`: a line that launches on several GPUs (``devices=8`` with a GPU
  accelerator or ``num_nodes``) carries the caveat ``NCCL: not yet run`` while the status table's
  NCCL row says so, and no line carries it once that row says otherwise.
- :func:`name_problems`: every name of the package a page mentions exists: dotted names
  (``lightning_sparse.x.y``, ``ls.Name``), a module's or a class's attribute (``packing.unpack``,
  ``SortedKeys.counts_in_blocks``), and repository paths (``lightning_sparse/wire/exchange.py``).
- :func:`see_problems`: a cross-reference is a link; ``see "Half-precision tables"`` in words
  points nowhere on the site.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import lightning_sparse

ROOT = Path(__file__).resolve().parent.parent
RESULTS = re.compile(r"<!-- results:begin -->(.*?)<!-- results:end -->", re.S)
STATUS = re.compile(r"<!-- --8<-- \[start:status\] -->(.*?)<!-- --8<-- \[end:status\] -->", re.S)
STATUS_INCLUDE = '--8<-- "README.md:status"'
CODE = re.compile(r"```.*?```", re.S)


def user_pages() -> dict[str, str]:
    """The pages a user reads first, whose figures must come from the results: README, home, guide."""
    pages = [ROOT / "README.md", ROOT / "docs" / "index.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
    return {str(p.relative_to(ROOT)): p.read_text() for p in pages}


def all_pages() -> dict[str, str]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return {str(p.relative_to(ROOT)): p.read_text() for p in pages}


# ------------------------------------------------------------------------------------- figures
# A ratio: "1.49x", "2-4x", "1.38-1.62x" (not "1M x 64": a ratio's "x" follows its number).
_FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?x\b")


def _numbers(text: str) -> set[float]:
    return {float(n) for match in _FIGURE.finditer(text) for n in match.groups() if n is not None}


def figure_problems(pages: dict[str, str], benchmarks_page: str) -> list[str]:
    """Each ratio quoted in ``pages`` (outside code) must be among the figures of the results block."""
    found = RESULTS.search(benchmarks_page)
    if found is None:
        return ["docs/benchmarks.md has no results block (<!-- results:begin --> ... <!-- results:end -->)"]
    measured = _numbers(found.group(1))
    problems = []
    for name, text in pages.items():
        for line_number, line in enumerate(CODE.sub(lambda m: "\n" * m.group(0).count("\n"), text).splitlines(), 1):
            for match in _FIGURE.finditer(line):
                missing = [n for n in match.groups() if n is not None and float(n) not in measured]
                if missing:
                    problems.append(f"{name}:{line_number}: {match.group(0)!r} is not a figure of the benchmark results")
    return problems


# -------------------------------------------------------------------------------------- status
# A claim about what ran on a GPU: tests that passed or failed there, code that has (not) run there.
_CLAIM = re.compile(
    r"\b(?:CUDA|GPU)[-/ \w]*\btests?\b[^.]*\b(?:pass|passe[sd]|fail(?:s|ed)?)\b"  # "every CUDA test passes"
    r"|\b(?:H100|GPU)\b[^.]*\b(?:passed|failed)\b"  # "on one H100, commit X failed 13"
    r"|\b(?:passed|failed)\b[^.]*\bon (?:one |an |a )?(?:NVIDIA )?(?:H100|GPU)\b"  # "all passed on one H100"
    r"|\b(?:not yet|never|have not|has not)\b[^.]*\b(?:run|ran)\b[^.]*\b(?:GPU|H100)\b",  # "not yet run on a GPU"
    re.I,
)


def status_problems(pages: dict[str, str]) -> list[str]:
    """A GPU status claim outside the README's status table (pages include the table instead)."""
    problems = []
    for name, text in pages.items():
        text = STATUS.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        text = RESULTS.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # measured, with commit and machine
        text = CODE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for number, paragraph in _paragraphs(text):
            if _CLAIM.search(paragraph):
                problems.append(f"{name}:{number}: a GPU status claim outside the status table: {paragraph[:120]!r}...")
    return problems


# A launch on several GPUs: devices=2 or more, with a GPU accelerator or several nodes, in either order on one line.
_GPUS = r'(?:accelerator="(?:gpu|cuda)"|num_nodes)'
_SEVERAL = r"devices[= ](?:[2-9]|[1-9]\d+)\b"
_LAUNCH = re.compile(rf"{_SEVERAL}.*?{_GPUS}|{_GPUS}.*?{_SEVERAL}")
NCCL_CAVEAT = "NCCL: not yet run"
NCCL_ROW = re.compile(r"^\| several GPUs \(NCCL\) \|(.*)$", re.M)


def launch_problems(pages: dict[str, str], readme: str) -> list[str]:
    """Each launch on several GPUs carries :data:`NCCL_CAVEAT` exactly while the README's status table has NCCL not run.

    A launch is judged by the code line, or the prose paragraph, that holds it.
    """
    row = NCCL_ROW.search(STATUS.search(readme).group(1)) if STATUS.search(readme) else None
    if row is None:
        return ["README.md: the status table has no 'several GPUs (NCCL)' row"]
    not_run = "not yet run" in row.group(1)
    problems = []
    for name, text in pages.items():
        code_lines = [line for block in CODE.findall(text) for line in block.splitlines()]
        prose = [paragraph for _, paragraph in _paragraphs(CODE.sub("", STATUS.sub("", text)))]
        for unit in code_lines + prose:
            if _LAUNCH.search(unit) and not_run and NCCL_CAVEAT not in unit:
                problems.append(f"{name}: a launch on several GPUs without '{NCCL_CAVEAT}': {unit.strip()[:100]!r}")
            elif NCCL_CAVEAT in unit and not not_run:
                problems.append(f"{name}: '{NCCL_CAVEAT}', but the status table's NCCL row says {row.group(1).strip()!r}")
    return problems


def _paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line number, text joined into one line) of each paragraph or list item."""
    out, start, lines = [], 0, []
    for number, line in enumerate(text.splitlines() + [""], 1):
        if not line.strip() or line.lstrip().startswith(("- ", "* ", "| ", "#")):
            if lines:
                out.append((start, " ".join(lines)))
            lines, start = ([line.strip()], number) if line.strip() else ([], 0)
        else:
            start = start or number
            lines.append(line.strip())
    return out


# --------------------------------------------------------------------------------------- names
_DOTTED = re.compile(r"\blightning_sparse(?:\.\w+)+")
_LS = re.compile(r"\bls\.([A-Za-z_]\w*)")
_SPAN = re.compile(r"`([^`\n]+)`")
_ATTRIBUTE = re.compile(r"^([A-Za-z_]\w*)\.([A-Za-z_]\w*)")
_PATH = re.compile(r"^((?:lightning_sparse|examples|benchmarks|tests|docs)/[\w./-]*)")


# Modules named like the variables of the examples (``rows.index_select``, ``fabric.setup``): not read as modules.
_VARIABLE_NAMES = {"rows", "fabric"}


def _package_names() -> tuple[dict[str, object], set[str]]:
    """Every module of the package by its last name and every class defined in it by name; the profiler labels."""
    objects: dict[str, object] = {}
    for info in pkgutil.walk_packages(lightning_sparse.__path__, "lightning_sparse."):
        module = importlib.import_module(info.name)
        if info.name.rsplit(".", 1)[1] not in _VARIABLE_NAMES:
            objects.setdefault(info.name.rsplit(".", 1)[1], module)
        for name, value in vars(module).items():
            if inspect.isclass(value) and value.__module__ == module.__name__:
                objects.setdefault(name, value)
    labels = set()
    for path in (ROOT / "lightning_sparse").rglob("*.py"):
        labels |= set(re.findall(r'record_function\("(lightning_sparse\.\w+)"\)', path.read_text()))
    return objects, labels


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def name_problems(pages: dict[str, str]) -> list[str]:
    """Names of the package that do not exist: dotted, ``ls.X``, ``module.attr``/``Class.attr`` in code spans, paths."""
    objects, labels = _package_names()
    problems = []
    for name, text in pages.items():
        for number, line in enumerate(text.splitlines(), 1):
            where = f"{name}:{number}"
            for dotted in _DOTTED.findall(line):
                if dotted not in labels and not _resolves(dotted):
                    problems.append(f"{where}: {dotted} does not exist")
            for attr in _LS.findall(line):
                if not hasattr(lightning_sparse, attr):
                    problems.append(f"{where}: ls.{attr} does not exist")
            for span in _SPAN.findall(line):
                path = _PATH.match(span)
                if path:
                    candidate = path.group(1).rstrip(".,:")
                    if "*" not in candidate and "<" not in candidate and not (ROOT / candidate).exists():
                        problems.append(f"{where}: {candidate} is not in the repository")
                    continue
                attribute = _ATTRIBUTE.match(span)
                if attribute and attribute.group(1) in objects and not span.startswith("lightning_sparse"):
                    owner, member = attribute.groups()
                    fields = getattr(objects[owner], "__dataclass_fields__", {})
                    if member != "py" and not hasattr(objects[owner], member) and member not in fields:
                        problems.append(f"{where}: {owner}.{member} does not exist")
    return problems


# ---------------------------------------------------------------------------------- references
_SEE = re.compile(r"""\bsee (?:the )?(?:section )?["'“]([^"'”]+)["'”]""", re.I)


def see_problems(pages: dict[str, str]) -> list[str]:
    """``see "X"`` outside a link: a reference the site cannot follow."""
    problems = []
    for name, text in pages.items():
        text = CODE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for number, line in enumerate(text.splitlines(), 1):
            for match in _SEE.finditer(line):
                if not line[match.end() :].startswith("]("):
                    problems.append(f"{name}:{number}: {match.group(0)!r} is not a link")
    return problems
