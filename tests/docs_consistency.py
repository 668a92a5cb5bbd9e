"""What the docs may claim: the checks of tests/test_docs_consistency.py, as functions of the pages' text.

The rules, each a function that returns the problems it finds (empty: none):

- :func:`figure_problems`: a measured figure quoted in the pages a user reads (README, the home
  page, the guide) or in the prose of docs/benchmarks.md (outside its results block) is one that
  ``make bench`` wrote into that results block (generated from ``benchmarks/results/bench.json``,
  naming the commit and the machine of every figure). A *measured figure* is, outside code
  (fenced blocks and inline spans):

  - a ratio: a number (or a range ``a-b``) followed by ``x``: ``2.3x``, ``1.38-1.62x``; it must be
    one of the results' ratios as written;
  - a time or a size: a number (or a range ``a-b``, ``a to b``) followed by a unit of time (``ns``,
    ``us``, ``ms``, ``s``, ``seconds``, ``minutes``, ``hours``) or of size (``B``, ``bytes``, ``KiB``,
    ``MiB``, ``GiB``, ``TiB``, ``KB``, ``MB``, ``GB``, ``TB``); not a rate (``GB/s``). It must be one of
    the results' times (or sizes) rounded to the quote's decimals, in any unit: ``1.64 ms`` quotes
    1.639 ms, ``71 GiB`` quotes 72646 MiB. The results' times and sizes are those written with a
    unit, the numbers of a table column whose header names one (``step (ms)``), and those of a
    table whose caption says which (``medians in ms``).

  Where a paragraph is about one section of the results, its figures are held to that section
  only: a paragraph that opens with a bold title that begins a section's heading
  (``**Two hosts over slow, lossy links**`` and ``### Two hosts over slow, lossy links``), and
  every paragraph of a guide page about one section (:data:`SECTION_OF_PAGE`). Elsewhere, any
  figure of the results will do.

  A number that is not a measurement (a design value, a setting, an assumption, arithmetic on
  them, or a figure of another run that the text names) is marked in its paragraph with an HTML
  comment, invisible on the site and on the code host, listing it as written (a figure the rule reads
  within a listed one is marked too: ``14 and 22 MiB`` marks ``22 MiB``), ``;`` between several::

      cut into bands of about 4 MiB <!-- not a result: 4 MiB -->

  A mark that names a figure its paragraph does not hold is a problem too, so marks do not outlive
  their figures.
- :func:`status_problems`: what has run on a GPU is said in one place, the status table of the
  README (marked ``status``); a page shows it through a copy of that table (:func:`copy_problems`).
  A sentence elsewhere that says CUDA tests passed or failed, or that the code has or has not run
  on a GPU, is a problem.
- :func:`copy_problems`: a page that shows a marked block of the README (``<!-- --8<-- [start:name] -->``
  ... ``[end:name]``: the quickstart, the status table; :data:`COPIES`) holds a copy of it between
  ``<!-- copy of README.md:name ... -->`` and ``<!-- end of the copy of README.md:name -->``, equal to
  the README's, so that the page reads whole as a file, on the code host too (an include line,
  ``--8<-- "README.md:name"``, shows there raw). ``python tests/docs_consistency.py`` writes the
  copies (:func:`write_copies`).
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
CODE = re.compile(r"```.*?```", re.S)


def user_pages() -> dict[str, str]:
    """The pages a user reads first, whose figures must come from the results: README, home, guide."""
    pages = [ROOT / "README.md", ROOT / "docs" / "index.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
    return {str(p.relative_to(ROOT)): p.read_text() for p in pages}


def figure_pages() -> dict[str, str]:
    """The pages whose figures :func:`figure_problems` holds to the results: the user pages and the benchmarks page."""
    return {**user_pages(), "docs/benchmarks.md": (ROOT / "docs" / "benchmarks.md").read_text()}


def all_pages() -> dict[str, str]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return {str(p.relative_to(ROOT)): p.read_text() for p in pages}


# ------------------------------------------------------------------------------------- figures
# A ratio: "1.49x", "2-4x", "1.38-1.62x" (not "1M x 64": a ratio's "x" follows its number).
_FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))?x\b")
# Units of time and size, in seconds and bytes.
TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "second": 1.0, "seconds": 1.0,
              "minute": 60.0, "minutes": 60.0, "hour": 3600.0, "hours": 3600.0}  # fmt: skip
SIZE_UNITS = {"B": 1.0, "byte": 1.0, "bytes": 1.0, "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30, "TiB": 2.0**40,
              "KB": 1e3, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}  # fmt: skip
UNITS = {**{unit: ("time", factor) for unit, factor in TIME_UNITS.items()},
         **{unit: ("size", factor) for unit, factor in SIZE_UNITS.items()}}  # fmt: skip
_NUMBER = r"\d+(?:,\d{3})*(?:\.\d+)?"
_UNIT = "|".join(sorted(map(re.escape, UNITS), key=len, reverse=True))
# A time or size: "0.27 ms", "1,100 us", "14.396us", "415-417 MiB", "459 to 465 MiB", "386/386 MiB"; not "450 GB/s".
_AMOUNT = re.compile(rf"(?<![\w.,])((?:{_NUMBER})(?:\s?(?:-|/|to)\s?{_NUMBER})*)\s?({_UNIT})(?![\w/])")
_UNIT_HEADER = re.compile(rf"\b({_UNIT})\b(?!/)")
_IN_UNIT = re.compile(rf"\bin ({_UNIT})\b(?!/)")
_NOT_A_RESULT = re.compile(r"<!--\s*not a result:(.*?)-->", re.S)
_BOLD_TITLE = re.compile(r"\*\*([^*]+?)\.?\*\*")
# The guide pages about one section of the results (their figures are held to it).
SECTION_OF_PAGE = {"docs/guide/dynamic.md": "Dynamic tables", "docs/guide/half.md": "Half-precision tables",
                   "docs/guide/gpu.md": "One GPU"}  # fmt: skip
_SPAN_CODE = re.compile(r"`[^`\n]*`")


def _numbers(text: str) -> set[float]:
    return {float(n) for match in _FIGURE.finditer(text) for n in match.groups() if n is not None}


def _values(numbers: str) -> list[str]:
    return re.findall(_NUMBER, numbers)


def _measured_amounts(results: str) -> dict[str, list[float]]:
    """The results' times (seconds) and sizes (bytes): each written with its unit, or in a table column whose header names
    one, or in a table whose caption (the line before it) says which (``medians in ms``)."""
    measured: dict[str, list[float]] = {"time": [], "size": []}
    for match in _AMOUNT.finditer(results):
        kind, factor = UNITS[match.group(2)]
        measured[kind] += [float(v.replace(",", "")) * factor for v in _values(match.group(1))]
    header: list[str] = []
    caption = ""
    for line in results.splitlines():
        if not line.startswith("|"):
            header, caption = [], line if line.strip() else caption
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not header:
            header = cells
            in_unit = _IN_UNIT.search(caption)
        elif not set("".join(cells)) <= set("-: "):  # a row, not the alignment line
            for title, cell in zip(header, cells):
                unit = _UNIT_HEADER.search(title) or in_unit
                if unit and not _AMOUNT.search(cell) and not _FIGURE.search(cell):
                    kind, factor = UNITS[unit.group(1)]
                    measured[kind] += [float(v.replace(",", "")) * factor for v in _values(cell)]
    return measured


def _quotes(number: str, unit: str, measured: dict[str, list[float]]) -> bool:
    """Whether ``number`` (as written) ``unit`` is one of the measured amounts rounded to its decimals."""
    kind, factor = UNITS[unit]
    value = float(number.replace(",", ""))
    half = 0.5 * 10.0 ** -len(number.partition(".")[2]) + 1e-9
    return any(abs(m / factor - value) <= half for m in measured[kind])


def _sections(results: str) -> dict[str, str]:
    """The results' sections by heading (``### ...``)."""
    parts = re.split(r"^### (.+)$", results, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def figure_problems(pages: dict[str, str], benchmarks_page: str) -> list[str]:
    """Each measured figure of ``pages`` (outside code and the results block) must be one of the results' figures."""
    found = RESULTS.search(benchmarks_page)
    if found is None:
        return ["docs/benchmarks.md has no results block (<!-- results:begin --> ... <!-- results:end -->)"]
    sections = _sections(found.group(1))

    def figures(text: str) -> tuple[set[float], dict[str, list[float]]]:
        return _numbers(text), _measured_amounts(text)

    everything = figures(found.group(1))
    problems = []
    for name, text in pages.items():
        text = RESULTS.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for number, paragraph in _paragraphs(CODE.sub(lambda m: "\n" * m.group(0).count("\n"), text)):
            title = _BOLD_TITLE.match(paragraph.lstrip("- "))
            title = SECTION_OF_PAGE.get(name) or (title.group(1) if title else None)
            scope = [body for heading, body in sections.items() if title and heading.startswith(title)]
            ratios, amounts = figures("\n".join(scope)) if scope else everything
            marked = [f.strip() for mark in _NOT_A_RESULT.findall(paragraph) for f in mark.split(";") if f.strip()]
            prose = _SPAN_CODE.sub(" ", _NOT_A_RESULT.sub(" ", paragraph))
            where = f"{name}:{number}" + (f" (results: {title})" if scope else "")
            problems += [f"{where}: marks {f!r} as not a result, but the paragraph does not hold it" for f in marked
                         if f not in prose]  # fmt: skip
            for match in _FIGURE.finditer(prose):
                missing = [n for n in match.groups() if n is not None and float(n) not in ratios]
                if missing and not any(match.group(0) in f for f in marked):
                    problems.append(f"{where}: {match.group(0)!r} is not a figure of the benchmark results")
            for match in _AMOUNT.finditer(prose):
                numbers, unit = match.groups()
                exempt = any(match.group(0) in f for f in marked)
                if not exempt and not all(_quotes(n, unit, amounts) for n in _values(numbers)):
                    problems.append(f"{where}: {match.group(0)!r} is not a figure of the benchmark results")
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
        text = _copies_blanked(text, "status")
        text = RESULTS.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # measured, with commit and machine
        text = CODE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for number, paragraph in _paragraphs(text):
            if _CLAIM.search(paragraph):
                problems.append(f"{name}:{number}: a GPU status claim outside the status table: {paragraph[:120]!r}...")
    return problems


# ---------------------------------------------------------------------------------------- copies
# The README's marked blocks (``<!-- --8<-- [start:name] -->`` ... ``[end:name]``), and the pages that show a copy of each.
README_BLOCK = re.compile(r"<!-- --8<-- \[start:(\w+)\] -->\n(.*?)<!-- --8<-- \[end:\1\] -->", re.S)
# A copy stands between blank lines, so that Markdown reads it as the README's text, not as part of the comments.
COPY = re.compile(r"<!-- copy of README\.md:(\w+)[^>]*-->\n\n?(.*?)\n?<!-- end of the copy of README\.md:\1 -->", re.S)
COPY_BEGIN = "<!-- copy of README.md:{name} (written by `python tests/docs_consistency.py`: edit the README, then run it) -->\n\n"
COPY_END = "\n<!-- end of the copy of README.md:{name} -->"
COPIES = {
    "docs/index.md": ("status",),
    "docs/guide/quickstart.md": ("quickstart", "status"),
    "docs/guide/launching.md": ("status",),
    "docs/benchmarks.md": ("status",),
}
_INCLUDE = re.compile(r'^\s*-{1,}8<-{1,}\s+["\']', re.M)  # pymdownx.snippets' include line: raw text on the code host


def readme_blocks(readme: str) -> dict[str, str]:
    return {name: body for name, body in README_BLOCK.findall(readme)}


def copy_blocks(pages: dict[str, str], readme: str) -> dict[str, str]:
    """``pages`` with each copy of a README block replaced by the block as the README has it now."""
    blocks = readme_blocks(readme)
    return {name: COPY.sub(lambda m: _copy(m.group(1), blocks.get(m.group(1), m.group(2))), text) for name, text in pages.items()}


def _copy(name: str, body: str) -> str:
    return COPY_BEGIN.format(name=name) + body + COPY_END.format(name=name)


def copy_problems(pages: dict[str, str], readme: str) -> list[str]:
    """A page of :data:`COPIES` without one of its copies, a copy that differs from the README's block, a copy of a
    block the README does not have, and an include line (``--8<-- "..."``) anywhere outside code."""
    blocks = readme_blocks(readme)
    problems = [f"README.md has no marked block {name!r}" for names in COPIES.values() for name in names if name not in blocks]
    for page, text in pages.items():
        copies = COPY.findall(text)
        for name in COPIES.get(page, ()):
            if name not in [copied for copied, _ in copies]:
                problems.append(
                    f"{page}: no copy of README.md:{name} (add its markers, then run python tests/docs_consistency.py)"
                )
        for name, body in copies:
            if name not in blocks:
                problems.append(f"{page}: a copy of README.md:{name}, which the README does not mark")
            elif body != blocks[name]:
                problems.append(
                    f"{page}: the copy of README.md:{name} differs from the README's (run python tests/docs_consistency.py)"
                )
        if _INCLUDE.search(CODE.sub("", text)):
            problems.append(f"{page}: an include line ('--8<--'), which the code host shows raw: copy the block instead")
    return problems


def _copies_blanked(text: str, name: str) -> str:
    """``text`` with its copies of README block ``name`` blanked (line numbers kept): they are the README's."""
    return COPY.sub(lambda m: "\n" * m.group(0).count("\n") if m.group(1) == name else m.group(0), text)


def write_copies() -> list[str]:
    """Write the README's marked blocks into every copy of them in docs/; return the pages changed."""
    readme = (ROOT / "README.md").read_text()
    changed = []
    for name, text in copy_blocks(all_pages(), readme).items():
        if text != (ROOT / name).read_text():
            (ROOT / name).write_text(text)
            changed.append(name)
    return changed


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
        prose = [paragraph for _, paragraph in _paragraphs(CODE.sub("", _copies_blanked(STATUS.sub("", text), "status")))]
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


if __name__ == "__main__":
    print("\n".join(f"wrote {name}" for name in write_copies()) or "every copy of a README block is up to date")
