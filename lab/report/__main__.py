"""Write REPORT.md, BLOG.md, HISTORY.md, figures.json and charts/ for a GPU's reports folder.

    python -m lab.report                         # reports/h200, from its newest full lease (and any later
                                                 # optional calls' folders); fails unless current
    python -m lab.report --lease run14           # a given lease folder
    python -m lab.report --draft                 # the newest result of each section across every lease: a layout
                                                 # review; the page says what it lacks instead of failing

A full lease holds the headline (calls 1-4); a later folder with only optional calls (serving, checks, warm-up)
adds its sections to it, each still checked for freshness. A folder `invalid/` inside a lease holds files that are
kept but not used (its README says why).

A current report needs every headline figure measured in that lease, at a commit that contains the newest engine
change behind it (lab.report.freshness), its ablation tables from the headline's commit, and SGLang beside it;
the blog's claims must hold on its numbers. Without --draft the command exits 1, writing nothing, when one fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lab import REPO
from lab.report import blog, history
from lab.report.report import Page, audit, write
from lab.report.sources import Sources, lease_folders

HEADLINE_SECTION = "bench06"  # what makes a lease folder a full one (call 1's headline and ablation)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", nargs="?", default=str(REPO / "reports" / "h200"))
    ap.add_argument("--lease", help="the lease folder (default: the newest under FOLDER)")
    ap.add_argument("--draft", action="store_true", help="every lease's newest results; report problems, not fail")
    a = ap.parse_args(argv)
    root = Path(a.folder)
    if a.draft:
        sources = Sources.of(root)
    else:
        leases = lease_folders(root)
        folders = [d for d, _ in leases]
        full = [d for d, src in leases if src.result(HEADLINE_SECTION)]
        lease = root / a.lease if a.lease else (full[-1] if full else None)
        if lease is None:
            raise SystemExit(f"no lease folder with the headline ({HEADLINE_SECTION}) under {root}")
        later = [] if a.lease else folders[folders.index(lease) + 1:]
        sources = Sources.of(lease, *later)
    page = Page(sources, root)
    audit(page)
    report = write(page, a.draft)
    post, blog_problems = blog.render(page, a.draft)
    page.problems += blog_problems
    if page.problems and not a.draft:
        print("the report is not current:\n" + "\n".join(f"- {p}" for p in page.problems), file=sys.stderr)
        return 1
    if page.problems:  # the draft's banner lists the blog's problems too
        report = write(page, a.draft)
    (root / "REPORT.md").write_text(report)
    (root / "BLOG.md").write_text(post)
    (root / "HISTORY.md").write_text(history.write(root))
    (root / "figures.json").write_text(json.dumps(
        {"about": "every number of REPORT.md and BLOG.md: its file, the path inside it, the commit (lab.report)",
         "draft": a.draft, "problems": page.problems, "sources": page.sources.files,
         "figures": page.book.entries}, indent=1, default=str) + "\n")
    print(f"wrote {root}/REPORT.md, BLOG.md ({blog.words(post)} words), HISTORY.md, figures.json, charts/"
          + (f"; {len(page.problems)} problems (draft)" if page.problems else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
