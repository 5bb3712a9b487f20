"""mkdocs hooks (mkdocs.yml, ``hooks:``): the pages and pictures generated at build time.

Nothing here is copied into docs/ by hand, so the site always shows what is recorded:

- The API reference pages (``REFERENCE_PAGES``) are written from the source: every name in the
  ``__all__`` of every public module (no component of its dotted path starts with ``_``), read
  statically as griffe reads them, one mkdocstrings ``:::`` directive each. A name that several
  public modules export (``richness.Monitor``, ``richness.monitor.Monitor``) is documented once,
  under its shortest public path, and the other modules' pages point to it. A public module on
  no page is a warning (``mkdocs build --strict`` fails), unless ``NOT_YET`` names it.

- ``benchmarks/RESULTS.md`` becomes the page "Benchmarks / Full record", at the same path
  inside the site, so that its own links (``results/*.png``) hold; ``benchmarks/results/*.png``
  are added beside it.
- ``benchmarks/index.md``, the benchmarks overview, is assembled from sections of RESULTS.md
  (their tables, notes and plots), named in ``OVERVIEW`` below; a section that is no longer
  there is a warning (and so a failure of ``mkdocs build --strict``).
- ``index.md`` gets README.md's pitch, picture, quickstarts and comparison (from
  ``**richness** measures`` up to ``## Documentation``) after its title, so that the two never
  differ; the README's links are pointed at the site's pages.
- ``experiments/results/*.png`` are added for docs/REPRODUCTION.md, and the links of the pages
  in docs/ written for reading them in the repository (``../experiments/results/...``,
  ``../benchmarks/RESULTS.md``) are pointed at the site's copies.
"""

from __future__ import annotations

import ast
import glob
import logging
import os
import re

from typing import Dict, Iterator, List, Optional, Tuple

from markdown.extensions.toc import slugify

log = logging.getLogger("mkdocs.hooks.richness")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")
README = os.path.join(ROOT, "README.md")
README_START, README_END = "**richness** measures", "## Documentation"

# The overview: (heading of a section of RESULTS.md, as it starts; the overview's title for it, or
# None for the section's own; whole: with its subsections, or its introduction alone).
OVERVIEW = [
    ("## Scaling, CKA libraries, precision, finishing", "Scaling and the CKA libraries: the run", False),
    ("### Scaling with n", None, True),
    ("### Scaling with p", None, True),
    ("### Head-to-head: linear CKA", "Against the minibatch CKA libraries", True),
    ("## Linear CKA: richness.Similarity against ckatorch", "Exact CKA against ckatorch", True),
    ("## Representation diagnostics on the Monitor, CPU", "Training monitor overhead", True),
    ("## Minibatch CKA over a loader", "The minibatch map over a loader: against the CKA libraries", True),
]

# The plots shown first, when benchmarks/results/ has them: (file, caption).
PLOTS = [
    ("scaling_n.png", "Time and peak memory against n (p = 256, C = 10): richness, the torch and NumPy loops "
                      "and the n x n formula (\"Scaling with n\" below)."),
    ("scaling_p.png", "Time and peak memory against the width p (n = 8,192, C = 100) (\"Scaling with p\" below)."),
    ("h2h.png", "Against the minibatch CKA libraries: error, time and memory against the batch size "
                "(n = 4,096, p = 256, C = 10) (\"Against the minibatch CKA libraries\" below)."),
]

INTRO = """# Benchmarks

The tables and plots below are taken, when the site is built, from the recorded results in
`benchmarks/RESULTS.md` ([the full record](RESULTS.md): every run with its machine, date, command
and the state of the code it measured) and `benchmarks/results/`. Ratios come from
configurations measured side by side in one run; absolute times on the shared 2-core machine
are noisy. The scripts are in `benchmarks/` (`python benchmarks/compare.py` for the scaling and
the CKA libraries, `python benchmarks/bench_cka.py` for the exact CKA, `python
benchmarks/bench_monitor.py` for the training monitor).
"""


def _heading_level(line: str) -> int:
    m = re.match(r"(#{1,6}) ", line)
    return len(m.group(1)) if m else 0


def section(text: str, start: str, *, whole: bool = True) -> str | None:
    """The section of ``text`` whose heading line starts with ``start``: up to the next heading
    of the same or a higher level (``whole``), or up to its first subheading (not ``whole``).
    None when there is no such heading."""
    lines = text.splitlines()
    level = _heading_level(start)
    for i, line in enumerate(lines):
        if line.startswith(start):
            end = len(lines)
            for j in range(i + 1, len(lines)):
                lj = _heading_level(lines[j])
                if lj and (lj <= level or not whole):
                    end = j
                    break
            return "\n".join(lines[i:end]).rstrip() + "\n"
    return None


def overview(text: str) -> str:
    """benchmarks/index.md: the plots of ``PLOTS`` present, then the sections of RESULTS.md named
    in ``OVERVIEW`` (without their pictures, shown above)."""
    parts = [INTRO]
    shown = [(name, caption) for name, caption in PLOTS
             if os.path.exists(os.path.join(ROOT, "benchmarks", "results", name))]
    if shown:
        parts.append("## At a glance\n")
        parts += [f"![{caption}](results/{name})\n\n*{caption}*\n" for name, caption in shown]
    for start, title, whole in OVERVIEW:
        body = section(text, start, whole=whole)
        if body is None:
            log.warning("benchmarks/RESULTS.md has no section starting %r (docs/hooks.py, OVERVIEW)", start)
            continue
        heading, _, rest = body.partition("\n")
        heading = heading.lstrip("#").strip()
        anchor = slugify(heading, "-")
        rest = re.sub(r"^!\[[^\]]*\]\(results/[^)]*\)\s*$", "", rest, flags=re.M)
        parts.append(f"## {title or heading}\n\n*From [{heading}](RESULTS.md#{anchor}) in the full record.*\n\n"
                     + demote(rest, _heading_level(start)))
    return "\n".join(parts)


def demote(text: str, level: int) -> str:
    """Subheadings of a section of ``level`` placed under the overview's ## heading for it; links
    to anchors of RESULTS.md pointed at the full record."""
    text = re.sub(r"^(#{2,6}) ", lambda m: "#" * min(6, len(m.group(1)) - level + 2) + " ", text, flags=re.M)
    return re.sub(r"\]\(#", "](RESULTS.md#", text)


PACKAGE_DIR = os.path.join(ROOT, "python", "richness")

# (page, title, the public modules on it, in order); the first public path of an object is where
# it is documented, so the top-level names come first.
REFERENCE_PAGES = [
    ("reference/richness.md", "The top-level package", ["richness"]),
    ("reference/monitor.md", "Monitoring training", ["richness.monitor", "richness.monitor.monitor",
                                                     "richness.monitor.routes"]),
    ("reference/torch.md", "Models: evaluate, similarity, the head hook",
     ["richness.torch.evaluate", "richness.torch.similarity", "richness.torch.hooks"]),
    ("reference/integrations.md", "torchmetrics, Lightning, Hugging Face",
     ["richness.torchmetrics", "richness.torchmetrics.metric", "richness.lightning", "richness.transformers"]),
    ("reference/dask.md", "Dask", ["richness.dask"]),
    ("reference/plot.md", "Plots", ["richness.plot"]),
    ("reference/baselines.md", "Baselines", ["richness.baselines"]),
    ("reference/finish.md", "Finishing math",
     ["richness.finish"] + [f"richness.finish.{m}" for m in (
         "dlr", "spectrum", "nc1", "isotropic", "diagnostics", "uncertainty", "policy", "samplespace", "cka",
         "similarity", "cca", "shape", "linreg", "lidar")]),
    ("reference/cli.md", "Command line and file formats",
     ["richness.cli", "richness.cli.formats", "richness.cli.formats.base"]
     + [f"richness.cli.formats.{m}" for m in ("npy", "npz", "h5", "parquet", "pt", "safetensors")]),
]

# Public modules with names that are not on the reference pages yet, and why.
NOT_YET: Dict[str, str] = {}


def module_file(name: str) -> Optional[str]:
    """The source of module ``name`` (a .py file, or the .pyi stub of a compiled module)."""
    base = os.path.join(PACKAGE_DIR, *name.split(".")[1:])
    for path in (os.path.join(base, "__init__.py"), base + ".py", base + ".pyi"):
        if os.path.isfile(path):
            return path
    return None


def public_modules() -> List[str]:
    """Dotted names of the public modules, from the source tree."""
    names = []
    for folder, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, f), PACKAGE_DIR)[:-3].split(os.sep)
            parts = ["richness"] + [p for p in rel if p != "__init__"]
            if not any(p.startswith("_") for p in parts):
                names.append(".".join(parts))
    return sorted(set(names))


def _statements(body: list) -> Iterator[ast.stmt]:
    """Module-level statements, those inside ``if`` (``TYPE_CHECKING``) and ``try`` included."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _statements(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _statements(node.body + node.orelse + node.finalbody
                                   + [s for h in node.handlers for s in h.body])


def module_info(name: str) -> Tuple[Optional[List[str]], Dict[str, Tuple[str, str]]]:
    """(``__all__`` or None, imported name -> (module, name)) of module ``name``, read statically."""
    path = module_file(name)
    if path is None:
        return None, {}
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    exported, imported = None, {}
    for node in _statements(tree.body):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                exported = list(ast.literal_eval(node.value))
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            source = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            for alias in node.names:
                imported[alias.asname or alias.name] = (source, alias.name)
    return exported, imported


def resolve(module: str, name: str) -> Tuple[str, str]:
    """Where ``module.name`` is defined, following the imports of the package's modules."""
    for _ in range(20):
        _, imported = module_info(module)
        if name not in imported or not imported[name][0].startswith("richness"):
            return module, name
        module, name = imported[name]
    return module, name


def reference_pages() -> Tuple[Dict[str, str], List[str]]:
    """({page: its Markdown}, problems): the API reference written from the modules' ``__all__``."""
    pages, problems = {}, []
    documented: Dict[Tuple[str, str], str] = {}
    placed = set()
    for page, title, modules in REFERENCE_PAGES:
        out = [f"# {title}", ""]
        for module in modules:
            exported, _ = module_info(module)
            if exported is None:  # not in this tree (yet)
                continue
            placed.add(module)
            out += [f"## `{module}`", "", f"::: {module}", "    options:", "      members: false",
                    "      show_root_heading: false", "      show_root_toc_entry: false", ""]
            aliases = []
            for name in exported:
                key = resolve(module, name)
                if key in documented:
                    aliases.append((f"{module}.{name}", documented[key]))
                    continue
                documented[key] = f"{module}.{name}"
                out += [f"::: {module}.{name}", ""]
            if aliases:
                out += ["Also here, documented under another public name:", "",
                        "| name | the same object as |", "|---|---|"]
                out += [f"| `{a}` | [`{c}`][{c}] |" for a, c in aliases] + [""]
        pages[page] = "\n".join(out) + "\n"
    for module in public_modules():
        exported, _ = module_info(module)
        if exported and module not in placed and module not in NOT_YET:
            problems.append(f"the public module {module} is on no page of the API reference "
                            f"(docs/hooks.py, REFERENCE_PAGES)")
    return pages, problems


def on_files(files, config):
    from mkdocs.structure.files import File

    pages, problems = reference_pages()
    for problem in problems:
        log.warning(problem)
    for page, content in pages.items():
        files.append(File.generated(config, page, content=content))
    if os.path.exists(RESULTS):
        with open(RESULTS, encoding="utf-8") as f:
            text = f.read()
        files.append(File.generated(config, "benchmarks/RESULTS.md", abs_src_path=RESULTS))
        files.append(File.generated(config, "benchmarks/index.md", content=overview(text)))
    else:
        log.warning("benchmarks/RESULTS.md is missing: the benchmark pages are empty")
        files.append(File.generated(config, "benchmarks/RESULTS.md", content="# Benchmark results\n\nNone recorded.\n"))
        files.append(File.generated(config, "benchmarks/index.md", content=INTRO))
    for folder in ("benchmarks/results", "experiments/results"):
        for path in sorted(glob.glob(os.path.join(ROOT, folder, "*.png"))):
            files.append(File.generated(config, f"{folder}/{os.path.basename(path)}", abs_src_path=path))
    return files


# Links written for the repository's layout (docs/X.md -> ../benchmarks/..., ../experiments/...)
# and where the same files are in the site (beside the pages of docs/).
REPOSITORY_LINKS = re.compile(r"\]\(\.\./(benchmarks/|experiments/results/)")


def readme_pitch() -> str:
    """README.md from ``README_START`` up to ``README_END``, its links pointed at the site's pages
    (docs/X -> X; benchmarks/RESULTS.md is a page of the site at the same path)."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        log.warning("README.md has no part from %r to %r for index.md (docs/hooks.py)", README_START, README_END)
        return ""
    return re.sub(r"\]\(docs/", "](", text[start:end])


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "index.md":
        title, _, rest = markdown.partition("\n")
        markdown = f"{title}\n\n{readme_pitch()}\n{rest}"
    if "/" not in page.file.src_uri:  # a page at the top of docs/
        markdown = REPOSITORY_LINKS.sub(r"](\1", markdown)
    return markdown
