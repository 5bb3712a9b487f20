"""mkdocs hooks (mkdocs.yml, ``hooks:``): the pages and pictures generated at build time.

Nothing here is copied into docs/ by hand, so the site always shows what is recorded:

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

import glob
import logging
import os
import re

from markdown.extensions.toc import slugify
from mkdocs.structure.files import File, Files

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


def on_files(files: Files, config) -> Files:
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
