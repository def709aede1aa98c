#!/usr/bin/env python
"""Build the larger training corpus for the embedded model and pre-tokenize it for a GPU run.

Sources, all English and all available offline on a Debian 12 (bookworm) machine:

* the Python text that ``lab/tinymodel/train.py`` has always used (standard-library docstrings,
  site-packages doc files and docstrings), with a larger cap;
* documentation packages from Debian ``main``, fetched with ``apt-get download`` (no root install:
  each ``.deb`` is unpacked with ``dpkg-deb -x`` under ``.train-data/root``), see ``PACKAGES``.

Markup (reStructuredText, HTML, POD, AsciiDoc) is stripped, text is whitespace-normalised and
de-duplicated by paragraph (the same rules as the old corpus: paragraphs under 40 characters or under
60% letters and spaces are dropped). The tokenizer is the one that ships in ``assets/tiny-qwen3``
(byte-level BPE, 4096 tokens): it is not retrained, so the tests keep their meaning.

Output (``.train-data/`` is git-ignored):

    .train-data/pack/train.u16.xz     uint16 token ids, documents joined by <|endoftext|> (id 0)
    .train-data/pack/heldout.u16.xz   the same for the held-out documents (one in 25, by hash)
    .train-data/pack/corpus.json      sources, licences, bytes and tokens per source, sha256 of the streams

The pack is what a GPU run carries (``carry: [".train-data/pack"]``). Run from the repository root:

    python -m lab.tinymodel.corpus            # fetch + unpack the .debs, build, tokenize, pack
    python -m lab.tinymodel.corpus --dump FILE   # also write the plain-text corpus to FILE
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html.parser
import json
import lzma
import re
import subprocess
import time
from pathlib import Path

import numpy as np

from lab.tinymodel import train as ttm  # also pins every thread pool to one thread

REPO = ttm.REPO
DATA = REPO / ".train-data"
ROOT = DATA / "root"
PACK = DATA / "pack"
TOKENIZER = REPO / "assets" / "tiny-qwen3" / "tokenizer.json"

# Debian packages (section doc, component main) and the licence their copyright file gives.
PACKAGES = {
    "python3.11-doc": "PSF-2.0 (Python documentation)",
    "linux-doc-6.1": "GPL-2 (Linux kernel documentation)",
    "perl-doc": "GPL-1+ or Artistic (Perl documentation)",
    "postgresql-doc-15": "PostgreSQL licence (PostgreSQL documentation)",
    "debian-handbook": "GPL-2.0+ or CC-BY-SA-3.0 (The Debian Administrator's Handbook)",
    "debian-reference-en": "GPL-2+ (Debian Reference)",
    "git-doc": "GPL-2 (Git documentation)",
    "gnu-standards": "GFDL-1.3+, no invariant sections (GNU Coding Standards, Information for Maintainers)",
    "manpages": "Linux man-pages: per-page free licences (GPL-2+, Verbatim, BSD; see its copyright file)",
    "manpages-dev": "Linux man-pages, sections 2 and 3: per-page free licences as manpages",
    "debian-policy": "GPL-2+ (Debian Policy Manual)",
    "developers-reference": "GPL-2 (Debian Developer's Reference)",
    "python-django-doc": "BSD-3-Clause (Django documentation)",
    "sphinx-doc": "BSD-2-Clause (Sphinx documentation)",
    "python-pandas-doc": "BSD-3-Clause (pandas documentation)",
    "python-scipy-doc": "BSD-3-Clause (SciPy documentation)",
}
PYTHON_CORPUS_CAP = 20_000_000  # the Python-installation sources (old corpus rules) stop here
PER_LINUX_DIR_CAP = 2_500_000  # bytes from any one Documentation/<dir> so no subsystem dominates
SCIPY_CAP = 5_000_000  # SciPy's HTML is mostly generated API pages: take the first 5 MB (sorted paths)
HELDOUT_EVERY = ttm.HELDOUT_EVERY
EOT_ID = 0
XZ_PRESET = 9 | lzma.PRESET_EXTREME


# =========================================================================================
# Fetching
# =========================================================================================
def fetch_packages() -> dict[str, str]:
    """Download the .debs (if missing) and unpack them under ROOT; return package -> version."""
    debs = DATA / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    missing = [p for p in PACKAGES if not list(debs.glob(f"{p}_*.deb"))]
    if missing:
        subprocess.run(["apt-get", "download", *missing], cwd=debs, check=True)
    versions = {}
    for pkg in PACKAGES:
        (deb,) = sorted(debs.glob(f"{pkg}_*.deb"))
        versions[pkg] = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], check=True,
                                       capture_output=True, text=True).stdout.strip()
        stamp = ROOT / ".unpacked" / deb.name
        if not stamp.exists():
            subprocess.run(["dpkg-deb", "-x", str(deb), str(ROOT)], check=True)
            stamp.parent.mkdir(parents=True, exist_ok=True)
            stamp.touch()
    return versions


# =========================================================================================
# Markup stripping
# =========================================================================================
RST_LINK = re.compile(r"`([^`<]+?)\s*<[^>`]+>`_{1,2}")  # `text <url>`_ -> text
RST_REF = re.compile(r"`([^`]+)`_{1,2}")  # `Section`_ -> Section
RST_SUBST = re.compile(r"\|([A-Za-z0-9_ -]+)\|")  # |version| -> version
RST_FIELD = re.compile(r"^\s*:[A-Za-z _-]+:.*$", re.M)  # :Author: ..., :maxdepth: 2


def strip_rst(text: str) -> str:
    text = RST_LINK.sub(r"\1", text)
    text = RST_REF.sub(r"\1", text)
    text = RST_SUBST.sub(r"\1", text)
    text = ttm.strip_markup(text)
    return RST_FIELD.sub("", text)


POD_CODE = re.compile(r"[BCEFIJLSXZ]<(?!<)([^<>]*)>")  # innermost single-bracket codes
POD_CODE_MULTI = re.compile(r"[BCEFIJLSXZ]<<+\s(.*?)\s>>+")  # C<< $a <=> $b >>
POD_ESC = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/", "quot": '"', "amp": "&"}


def _pod_code(m: re.Match) -> str:
    code, body = m.group(0)[0], m.group(1)
    if code == "E":
        return POD_ESC.get(body, "")
    if code in "XZ":
        return ""
    if code == "L":  # L<text|target> -> text; L<perlfunc/open> -> perlfunc/open
        return body.split("|")[0]
    return body


def strip_pod(text: str) -> str:
    lines = []
    skip = False
    for line in text.split("\n"):
        if line.startswith("=begin") or line.startswith("=for"):
            skip = line.startswith("=begin")
            continue
        if line.startswith("=end"):
            skip = False
            continue
        if skip:
            continue
        if line.startswith("=head") or line.startswith("=item"):
            lines.extend(["", line.split(None, 1)[1] if " " in line else "", ""])
            continue
        if line.startswith("="):  # =pod, =cut, =over, =back, =encoding
            lines.append("")
            continue
        lines.append(line)
    text = "\n".join(lines)
    text = POD_CODE_MULTI.sub(lambda m: m.group(1), text)
    for _ in range(4):  # nested codes: B<C<foo>>
        text = POD_CODE.sub(_pod_code, text)
    return text


ADOC_LINK = re.compile(r"(?:linkgit|link|https?):([^\[\s]*)\[([^\]]*)\]")
ADOC_ANCHOR = re.compile(r"\[\[[^\]]*\]\]|^\[[a-z][^\]]*\]\s*$", re.M)  # [[anchor]], [verse]
ADOC_ATTR = re.compile(r"^:[a-z-]+:.*$|^ifdef::.*$|^endif::.*$|^include::.*$", re.M)


def strip_asciidoc(text: str) -> str:
    text = ADOC_LINK.sub(lambda m: m.group(2) or m.group(1), text)
    text = ADOC_ANCHOR.sub("", text)
    text = ADOC_ATTR.sub("", text)
    text = re.sub(r"`([^`\n]+)`", r"\1", text)
    text = re.sub(r"(?<![\w'])'([^'\n]+)'(?![\w'])", r"\1", text)  # 'emphasis'
    return re.sub(r"^(?:-{4,}|={4,}|\.{4,}|\+{4,}|~{4,}|\*{4,})\s*$", "", text, flags=re.M)


class HTMLText(html.parser.HTMLParser):
    """Visible text of an HTML page, with paragraph breaks at block elements.

    Navigation chrome (DocBook's navheader/navfooter, Sphinx's related bars), scripts and styles
    are skipped; <pre> keeps its line breaks.
    """

    BLOCK = {"p", "div", "br", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "tr", "pre",
             "table", "ul", "ol", "dl", "blockquote", "section", "title", "td", "th"}
    SKIP = {"script", "style", "head", "nav"}
    SKIP_CLASSES = {"navheader", "navfooter", "related", "sphinxsidebar", "footer", "toc"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip_depth = 0  # > 0 inside a skipped element
        self.stack: list[bool] = []  # for <div>: was it a skipped one
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        classes = set((dict(attrs).get("class") or "").split())
        if tag == "div":
            skipped = bool(classes & self.SKIP_CLASSES)
            self.stack.append(skipped)
            self.skip_depth += skipped
        elif tag in self.SKIP:
            self.skip_depth += 1
        if tag == "pre":
            self.pre += 1
        if tag in self.BLOCK:
            self.parts.append("\n\n" if tag not in {"br", "td", "th"} else "\n")

    def handle_endtag(self, tag):
        if tag == "div" and self.stack:
            self.skip_depth -= self.stack.pop()
        elif tag in self.SKIP:
            self.skip_depth = max(0, self.skip_depth - 1)
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in self.BLOCK:
            self.parts.append("\n\n")

    def handle_data(self, data):
        if self.skip_depth:
            return
        self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))

    def text(self) -> str:
        text = "".join(self.parts)
        return "\n".join(line.strip() if not line.startswith("    ") else line for line in text.split("\n"))


def html_to_text(raw: str) -> str:
    parser = HTMLText()
    parser.feed(raw)
    parser.close()
    return parser.text().replace("\u00b6", "")  # Sphinx's pilcrow header links


SKIP_HTML = {"genindex.html", "search.html", "py-modindex.html", "np-modindex.html"}


def doc_pages(root: Path) -> list[Path]:
    """HTML pages of a Sphinx site, without its index/search pages and highlighted source (_modules)."""
    return [p for p in root.rglob("*.html")
            if p.name not in SKIP_HTML and not any(part.startswith("_") for part in p.relative_to(root).parts)]


def man_to_text(path: Path) -> str:
    """Render one man page with groff (left-adjusted, no hyphenation, one page) and drop its indent."""
    roff = gzip.decompress(path.read_bytes())
    if roff.lstrip().startswith(b".so "):  # a stub that points at another page
        return ""
    cmd = ["groff", "-t", "-man", "-Tutf8", "-P-cbou", "-rcR=1", "-rLL=100n", "-rHY=0"]
    out = subprocess.run(cmd, input=roff, capture_output=True, check=False).stdout.decode("utf-8", "replace")
    lines = out.split("\n")[1:-2]  # the running header and footer
    lines = [line[7:] if line.startswith("       ") else line.strip() for line in lines]
    # groff justifies prose with runs of spaces; collapse them in lines that start flush (not code).
    return "\n".join(re.sub(r"(?<=\S) {2,}(?=\S)", " ", line) if line[:1] != " " else line for line in lines)


# =========================================================================================
# Sources
# =========================================================================================
def read(path: Path) -> str:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return data.decode("utf-8", errors="replace")


def debian_sources(cb: ttm.CorpusBuilder) -> None:
    """Add every Debian documentation package, one document per file, in sorted order."""
    share = ROOT / "usr" / "share"
    doc = share / "doc"

    def add_files(files, convert, source, per_dir_cap=None, dir_of=None, raw=False):
        per_dir: dict[str, int] = {}
        before = cb.size
        for p in sorted(files):
            if p.is_symlink():
                continue
            key = dir_of(p) if dir_of else ""
            if per_dir_cap and per_dir.get(key, 0) >= per_dir_cap:
                continue
            per_dir[key] = per_dir.get(key, 0) + cb.add(convert(p if raw else read(p)), source)
        print(f"[corpus] + {source}: {cb.size - before:,} bytes", flush=True)

    py = doc / "python3.11" / "html" / "_sources"
    add_files(py.rglob("*.rst.txt"), strip_rst, "python3.11-doc")
    linux = doc / "linux-doc-6.1" / "Documentation"
    add_files([p for p in linux.rglob("*.gz") if p.name.endswith((".rst.gz", ".txt.gz"))],
              strip_rst, "linux-doc-6.1", PER_LINUX_DIR_CAP,
              lambda p: p.relative_to(linux).parts[0])
    add_files((share / "perl").rglob("*.pod"), strip_pod, "perl-doc")
    add_files((doc / "postgresql-doc-15" / "html").glob("*.html"), html_to_text, "postgresql-doc-15")
    add_files((doc / "debian-handbook" / "html" / "en-US").glob("*.html"), html_to_text,
              "debian-handbook")
    add_files([p for p in (share / "debian-reference").glob("*.txt.gz")], lambda t: t,
              "debian-reference-en")
    add_files((doc / "git-doc").glob("*.txt"), strip_asciidoc, "git-doc")
    add_files((doc / "gnu-standards").glob("*.text.gz"), lambda t: t, "gnu-standards")
    man = share / "man"
    add_files([p for p in man.glob("man[2-3]/*.gz")], man_to_text, "manpages-dev", raw=True)
    add_files([p for p in man.glob("man[145678]/*.gz")], man_to_text, "manpages", raw=True)
    add_files([doc / "debian-policy" / "policy.txt.gz"], lambda t: t, "debian-policy")
    add_files([share / "developers-reference" / "developers-reference.txt.gz"], lambda t: t,
              "developers-reference")
    add_files(doc_pages(doc / "python-django-doc" / "html"), html_to_text, "python-django-doc")
    add_files((doc / "sphinx-doc").rglob("_sources/**/*.txt"), strip_rst, "sphinx-doc")
    add_files((doc / "python-pandas-doc").rglob("_sources/**/*.txt"), strip_rst, "python-pandas-doc")
    add_files(doc_pages(doc / "python-scipy-doc" / "html"), html_to_text, "python-scipy-doc",
              SCIPY_CAP)


# =========================================================================================
# Tokenizing and packing
# =========================================================================================
def tokenize(docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Encode with the shipped tokenizer; split train / held-out by document hash (as before)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    assert tok.token_to_id("<|endoftext|>") == EOT_ID and tok.get_vocab_size() <= 65536
    train: list[np.ndarray] = []
    held: list[np.ndarray] = []
    eot = np.array([EOT_ID], dtype=np.uint16)
    for start in range(0, len(docs), 256):
        chunk = docs[start:start + 256]
        for doc, enc in zip(chunk, tok.encode_batch(chunk, add_special_tokens=False)):
            h = int.from_bytes(hashlib.sha1(doc.encode("utf-8")).digest()[:4], "little")
            target = held if h % HELDOUT_EVERY == 0 else train
            target.append(np.asarray(enc.ids, dtype=np.uint16))
            target.append(eot)
    return np.concatenate(train), np.concatenate(held)


def write_stream(ids: np.ndarray, path: Path) -> dict:
    raw = ids.astype("<u2").tobytes()
    path.write_bytes(lzma.compress(raw, preset=XZ_PRESET))
    return {"file": path.name, "tokens": int(ids.size), "sha256_uint16": hashlib.sha256(raw).hexdigest(),
            "compressed_bytes": path.stat().st_size}


def load_stream(path: Path) -> np.ndarray:
    """Inverse of write_stream (used by the trainer)."""
    return np.frombuffer(lzma.decompress(path.read_bytes()), dtype="<u2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", type=Path, help="also write the plain-text corpus here")
    args = ap.parse_args()
    t0 = time.time()
    versions = fetch_packages()

    ttm.CORPUS_CAP = PYTHON_CORPUS_CAP
    docs, python_info = ttm.build_corpus()
    cb = ttm.CorpusBuilder()  # the new builder de-duplicates against everything before it too
    for d in docs:
        cb.add(d, "python installation")
    cb.by_source = dict(python_info["bytes_by_source"])
    debian_sources(cb)
    print(f"[corpus] {len(cb.docs):,} documents, {cb.size:,} bytes ({time.time() - t0:.0f}s)", flush=True)
    if args.dump:
        args.dump.write_text("\n<|endoftext|>\n".join(cb.docs), encoding="utf-8")

    t = time.time()
    train, held = tokenize(cb.docs)
    print(f"[tokens] train {train.size:,}, held-out {held.size:,}, "
          f"{cb.size / (train.size + held.size):.2f} bytes/token ({time.time() - t:.0f}s)", flush=True)
    PACK.mkdir(parents=True, exist_ok=True)
    t = time.time()
    streams = {"train": write_stream(train, PACK / "train.u16.xz"),
               "heldout": write_stream(held, PACK / "heldout.u16.xz")}
    print(f"[pack] {sum(s['compressed_bytes'] for s in streams.values()) / 1e6:.1f} MB "
          f"({time.time() - t:.0f}s)", flush=True)
    info = {
        "bytes": cb.size,
        "documents": len(cb.docs),
        "bytes_by_source": cb.by_source,
        "debian_packages": {p: {"version": versions[p], "licence": PACKAGES[p]} for p in PACKAGES},
        "python": python_info["python"],
        "tokenizer": "assets/tiny-qwen3/tokenizer.json (byte-level BPE, 4096 tokens)",
        "heldout_rule": f"sha1(document)[:4] little-endian % {HELDOUT_EVERY} == 0",
        "streams": streams,
        "command": "python -m lab.tinymodel.corpus",
    }
    (PACK / "corpus.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"[done] {PACK} in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
