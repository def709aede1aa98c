"""The JSON a report reads: lease folders of lab.run, lab.sglang and lab.timeline files, each run with its provenance.

A `Run` is one section's result in one file (or one timeline file) with the file's environment: commit, time,
any MINISGL_* settings it ran with. `Sources.value(path)` finds a figure by a dotted path
("bench06.default.w1.output_tok_per_s"): the newest run of that section that holds the path and ran with default
settings, returned with where it came from, so every number in a report names its file and commit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lab import REPO


@dataclass(frozen=True)
class Run:
    section: str  # a lab.run / lab.sglang section, or "timeline:<model>" for a lab.timeline file
    result: dict
    file: str  # relative to the repository
    commit: str
    time_utc: str
    settings: dict  # MINISGL_* environment settings the run had (empty: defaults)
    dirty: bool
    engine: str  # "minisgl" or "sglang"


@dataclass(frozen=True)
class Value:
    """A figure read from a run: the number, the run, and the path inside its result."""

    value: float
    run: Run
    path: str

    def provenance(self) -> dict:
        return {"file": self.run.file, "section": self.run.section, "path": self.path, "commit": self.run.commit,
                "time_utc": self.run.time_utc, "engine": self.run.engine}


def rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def timeline_model(data: dict) -> str:
    """The lab.models name of a timeline file's model (older files recorded a config folder)."""
    return Path(str(data.get("model", "qwen3-0.6b"))).name


def load_file(path: Path) -> list[Run]:
    data = json.loads(path.read_text())
    env = data.get("environment", {})
    common = dict(file=rel(path), commit=env.get("git_commit") or "?", time_utc=env.get("time_utc", ""),
                  settings=env.get("minisgl_env") or {}, dirty=bool(env.get("git_dirty")))
    if path.name.startswith("decode_timeline_"):
        default = not data.get("switches") and data.get("root", "this checkout") == "this checkout"
        return [Run(f"timeline:{timeline_model(data)}", data, engine="minisgl",
                    **{**common, "settings": common["settings"] if default else {"non_default": True}})]
    engine = "sglang" if data.get("engine") == "sglang" else "minisgl"
    return [Run(name, sec["result"], engine=engine, **common)
            for name, sec in data.get("sections", {}).items() if "result" in sec]


class Sources:
    """Every run in some JSON files; lookups take the newest run with default settings that has the path."""

    def __init__(self, files: list[Path]):
        self.files = sorted({rel(f) for f in files})
        self.runs: list[Run] = []
        self.environments: dict[str, dict] = {}  # file -> its environment
        self.commands: dict[str, str] = {}  # file -> the lab command that wrote it (files from before lab/: none)
        self.sglang: dict[str, dict] = {}  # model -> SGLang's version and engine settings (lab.sglang files)
        for f in files:
            try:
                self.runs += load_file(f)
                data = json.loads(f.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue  # a log or a foreign file
            self.environments[rel(f)] = data.get("environment", {})
            if data.get("command"):
                self.commands[rel(f)] = data["command"]
            self.sglang.update(data.get("sglang", {}) if isinstance(data.get("sglang"), dict) else {})
        self.runs.sort(key=lambda r: r.time_utc, reverse=True)

    @classmethod
    def of(cls, *paths: str | Path) -> Sources:
        """Folders (every *.json under them, but not under a folder named `invalid`) and files."""
        files: list[Path] = []
        for p in map(Path, paths):
            if p.is_dir():
                files += sorted(f for f in p.rglob("*.json") if "invalid" not in f.relative_to(p).parts[:-1])
            else:
                files.append(p)
        return cls(files)

    def runs_of(self, section: str, defaults_only: bool = True) -> list[Run]:
        return [r for r in self.runs if r.section == section
                and (not defaults_only or not r.settings or r.engine != "minisgl")]

    def value(self, *paths: str) -> Value | None:
        """The newest run holding one of the paths (the earlier path when one run holds several). A path is a
        section name (which may hold dots: "timeline:qwen3-0.6b") and keys, joined by dots."""
        for run in self.runs:
            if run.settings and run.engine == "minisgl":  # SGLang's runs do not read minisgl's settings
                continue
            for path in paths:
                if path == run.section or path.startswith(run.section + "."):
                    keys = path[len(run.section) + 1:].split(".") if path != run.section else []
                    x = dig(run.result, keys)
                    if x is not None:
                        return Value(x, run, path)
        return None

    def result(self, section: str) -> Run | None:
        runs = self.runs_of(section)
        return runs[0] if runs else None

    def commits(self) -> list[str]:
        return sorted({r.commit for r in self.runs if r.engine == "minisgl"})


def dig(d, keys: list[str]):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def lease_folders(root: str | Path) -> list[tuple[Path, Sources]]:
    """The lease folders under a reports folder (runN/ with JSON in them) with their runs, oldest first by their
    newest file."""
    found = []
    for d in Path(root).glob("run*/"):
        src = Sources.of(d)
        if src.runs:
            found.append((max(r.time_utc for r in src.runs), d, src))
    return [(d, src) for _, d, src in sorted(found, key=lambda x: x[:2])]


def resolve(entry: dict, root: Path = REPO):
    """The value a figures.json entry names, read again from its file (None when the file or path is gone)."""
    path = root / entry["file"]
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if entry.get("engine") == "anchor":
        return dig(data, entry["keys"])
    section = entry["section"]
    result = data if section.startswith("timeline:") else dig(data, ["sections", section, "result"])
    keys = entry["path"][len(section) + 1:].split(".") if entry["path"] != section else []
    return dig(result, keys)
