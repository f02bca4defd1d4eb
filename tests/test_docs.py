"""The documents: the tree speaks of the project alone, and the facts that can drift across README, guide,
manual and benchmarks/RESULTS.md (preset names, times, figures, each figure's provenance) agree."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from relicv2.evaluation.job import FINETUNE_PRESETS, LINEAR_PRESETS
from relicv2.pretrain.config import PRESETS as PRETRAIN_PRESETS
from relicv2.saliency.network.config import PRESETS as SALIENCY_PRESETS
from tests.paths import CONFIGS, REPO

RESULTS = REPO / "benchmarks" / "RESULTS.md"
DOCS = {name: REPO / name for name in ("README.md", "docs/guide.md", "docs/operations.md")}

# References to how the project was built rather than to the project: numbered work rounds, issues,
# sessions and goals, "#N" tickets, and the names of the tools that built it. The words are split so
# that this file does not match itself.
WORK_REFERENCES = re.compile(
    r"\b(?:work[ -]?)?(?:issue|round|session|goal|ticket|pull request|PR)s?\s*(?:#\s*)?\d+"
    r"|(?<![\w&#])#\d+\b(?![;\w])"  # "#42" in prose; CSS colours ("#222;") are not tickets
    r"|\b(?:" + "|".join(["cla" + "ude", "anthro" + "pic", "chat" + "gpt", "open" + "ai", "co" + "pilot",
                          "co" + "dex"]) + r")\b",
    re.IGNORECASE,
)


def _tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    files = []
    for name in filter(None, listed):
        path = REPO / name
        if path.is_file() and path != Path(__file__).resolve():
            files.append(path)
    return files


def _work_references(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []  # binary files (images, archives) hold no prose
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in WORK_REFERENCES.finditer(line):
            found.append(f"{path.relative_to(REPO)}:{number}: {match.group(0)!r} in {line.strip()[:100]!r}")
    return found


def test_the_pattern_finds_work_references_and_spares_the_project_vocabulary():
    # Split like the pattern's own words, so that this file does not hold what it forbids.
    for prose in ("as in iss" + "ue 16", "(sess" + "ion 15)", "rou" + "nd 3 of the work", "see #" + "42 for why",
                  "go" + "al 1 met", "Iss" + "ue #7", "written with " + "Clau" + "de"):
        assert WORK_REFERENCES.search(prose), prose
    for prose in ("color: #222;", "step 3 of 4", "3 rounds of refinement", "the first round", "a test session",
                  "phase I", "call A", "epoch 2", "checkpoint 4"):
        assert not WORK_REFERENCES.search(prose), prose


def test_the_tree_speaks_of_the_project_alone():
    found = [hit for path in _tracked_text_files() for hit in _work_references(path)]
    assert not found, "references to work rounds, issues, sessions or tools:\n" + "\n".join(found[:40])


# ---- presets named in the documents exist


def _doc_texts() -> dict[str, str]:
    return {name: path.read_text() for name, path in {**DOCS, "benchmarks/RESULTS.md": RESULTS}.items()}


def test_config_presets_named_in_the_documents_exist():
    named = {(doc, name) for doc, text in _doc_texts().items()
             for name in re.findall(r"pretrain/presets/([\w.-]+)\.yaml", text)}
    assert named, "no preset file is named in the documents"
    missing = [f"{doc}: pretrain/presets/{name}.yaml" for doc, name in sorted(named)
               if not (CONFIGS / f"{name}.yaml").is_file()]
    assert not missing, f"preset files named in the documents but absent from {CONFIGS}: {missing}"


def test_command_presets_named_in_the_documents_exist():
    """Every `--config NAME` in the documents names a preset of that command (a path is a file, not checked)."""
    commands = {"saliency train": SALIENCY_PRESETS, "eval finetune": FINETUNE_PRESETS, "eval linear": LINEAR_PRESETS,
                "pretrain": PRETRAIN_PRESETS}
    problems = []
    for doc, text in _doc_texts().items():
        # A command may continue over lines ending in "\"; join them so each command is one line.
        for line in text.replace("\\\n", " ").splitlines():
            for match in re.finditer(r"--config[ =]`?([\w|-]+)(?![\w./-])", line):
                names = match.group(1).split("|")  # a synopsis such as `--config tiny|demo|cpu|paper`
                before = line[:match.start()]  # the option belongs to the last command named before it
                owner = max(commands, key=lambda command: before.rfind(command))
                owners = [commands[owner]] if owner in before else list(commands.values())
                allowed = set().union(*(p.names() for p in owners))
                problems += [f"{doc}: --config {name} in {line.strip()[:90]!r}" for name in names if name not in allowed]
    assert not problems, "presets the code does not have:\n" + "\n".join(problems)


def test_the_guide_names_the_saliency_preset_the_demo_script_uses():
    script = (REPO / "scripts" / "demo.sh").read_text()
    full_demo = script.split("else", 1)[1]  # the branch after the reduced demo's settings
    preset = re.search(r"saliency_preset=(\w+)", full_demo).group(1)
    demo_section = DOCS["docs/guide.md"].read_text().split("## Try it: the demo")[1].split("\n## ")[0]
    assert f"--config {preset}`" in demo_section or f"--config {preset} " in demo_section, \
        f"scripts/demo.sh trains `saliency train --config {preset}`; the guide's demo section should say so"
    assert re.findall(r"saliency train\s+--config (\w+)", demo_section)[0] == preset


# ---- figures quoted in several places agree with benchmarks/RESULTS.md


def _number(text: str) -> str:
    return text.replace(",", "").replace("~", "").strip()


# (fact, where RESULTS.md states it, how the other documents quote it). Every quoting pattern must be found
# somewhere, so a reworded sentence fails here instead of silently leaving the check.
FACTS = [
    ("the Imagenette preset's wall time (min)",
     r"\*\*`imagenette-r18-cpu`\*\* \(peak lr 0\.3\) \| \*\*(\d+) min\*\*",
     [r"~?(\d+)-minute run of\s+`pretrain/presets/imagenette-r18-cpu", r"6 epochs, ~?(\d+) min on 2 cores",
      r"\| ~?(\d+) min \(6 epochs, `imagenette-r18-cpu`\)", r"the pretraining without masks took ~?(\d+) min"]),
    ("the Imagenette preset's kNN top-1",
     r"\*\*`imagenette-r18-cpu`\*\*[^\n]*\| \*\*(0\.\d{3})\d\*\* \|",
     [r"kNN top-1 from 0\.362 \(random init\) to (0\.\d+)", r"kNN top-1 0\.362 -> (0\.\d+)"]),
    ("the Imagenette preset's linear-fast top-1",
     r"\*\*`imagenette-r18-cpu`\*\*[^\n]*\| \*\*(0\.\d{3}\d)\*\* / 0\.\d+ \|",
     [r"linear \(`fast`\) top-1 from 0\.365 to (0\.\d+)", r"linear \(`fast`\) top-1\s+0\.365 -> (0\.\d+)"]),
    ("the demo from a clean clone",
     r"from a clean clone, set-up included \| \*\*(\d+ min \d+ s)\*\*",
     [r"[Ff]rom a clean clone, set-up\s+included, (?:it|`make demo`) took (\d+ min \d+ s)"]),
    ("the H100's compiled step (img/s)",
     r"train step, compiled \| \*\*([\d,]+) img/s",
     [r"compiled (?:ResNet-50 )?step runs at ([\d,]+) im(?:g|ages)/s"]),
    ("the H100's view pipeline (img/s)",
     r"view pipeline \(torch colour stage, the default\) \| \*\*([\d,]+) img/s",
     [r"view pipeline (?:makes|at) ([\d,]+) img/s"]),
    ("the H100's pretrain end to end (img/s)",
     r"\*\*([\d,]+) img/s = 0\.\d+x the compiled step\*\*",
     [r"`relicv2 pretrain` (?:at|sustains) ([\d,]+) img/s", r"one H100 measured ([\d,]+) img/s end to end",
      r"at ([\d,]+) images/s \(measured", r"([\d,]+) img/s per H100 \(measured\)"]),
    ("the fast protocol's cache of ImageNet's train set (GiB)",
     r"1\.28 M bank\s+is a \*\*([\d.]+) GiB\*\* cache file",
     [r"are a ([\d.]+) GiB cache file", r"\(([\d.]+) GiB for train, measured\)"]),
    ("the kNN search's time a query on the CPU box at 1.28 M (ms)",
     r"The kNN search is compute: (\d+) ms a query at 1\.28 M",
     [r"search took (\d+) ms a\s+query at that size"]),
    ("rank 0 of 64's planning of 1.28 M inputs (CPU s)",
     r"with its tars done spent ([\d.]+) s of CPU",
     [r"rank 0 of 64 spent ([\d.]+) s of CPU"]),
    ("a half-done build-masks' rerun to its first batch (s)",
     r"half its units done \(39 of 79 at 100 k\) reaches its first batch\s+([\d.]+) s",
     [r"half done reaches its first batch ([\d.]+) s"]),
]


def _rounded_like(value: str, quoted: str) -> str:
    """`value` (from RESULTS.md) to the precision `quoted` uses: 0.5157 quoted as 0.516."""
    if re.fullmatch(r"\d+\.\d+", value) and re.fullmatch(r"\d+\.\d+", quoted):
        digits = len(quoted.split(".")[1])
        return f"{float(value):.{digits}f}"
    return value


@pytest.mark.parametrize("fact, source, quotes", FACTS, ids=[fact for fact, _, _ in FACTS])
def test_figures_quoted_in_the_documents_agree_with_results(fact, source, quotes):
    stated = re.search(source, RESULTS.read_text())
    assert stated, f"benchmarks/RESULTS.md no longer states {fact} as /{source}/"
    value = _number(stated.group(1))
    texts = {name: path.read_text() for name, path in DOCS.items()}
    disagreements = []
    for pattern in quotes:
        hits = [(doc, _number(m.group(1))) for doc, text in texts.items() for m in re.finditer(pattern, text)]
        assert hits, f"no document quotes {fact} as /{pattern}/ any more: update FACTS with the new wording"
        disagreements += [f"{doc}: {quoted}" for doc, quoted in hits if _rounded_like(value, quoted) != quoted]
    assert not disagreements, f"{fact} is {value} in benchmarks/RESULTS.md but: {disagreements}"


# ---- every table of RESULTS.md says where its figures come from


def _tables_with_context(text: str) -> list[tuple[str, str, str]]:
    """(heading, text since the heading or the previous table, header row) for each markdown table."""
    tables, heading, context, lines = [], "", [], text.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("#"):
            heading, context = line, []
        elif line.startswith("|"):
            header = line
            while index < len(lines) and lines[index].startswith("|"):
                index += 1
            tables.append((heading, "\n".join(context), header))
            context = []
            continue
        else:
            context.append(line)
        index += 1
    return tables


def test_every_results_table_names_command_machine_date_and_commit():
    tables = _tables_with_context(RESULTS.read_text())
    assert len(tables) >= 20
    problems = []
    for heading, context, header in tables:
        columns = header.lower()
        has = {
            "command": "command" in columns or re.search(r"\bcommands?\b", context, re.I),
            "machine": "machine" in columns or re.search(r"CPU box|H[12]00", context),
            "date": "date" in columns or re.search(r"\b20\d\d-\d\d-\d\d\b", context),
            "commit": "commit" in columns or re.search(r"\bcommits?:? [0-9a-f]{7}\b|\bcode at [0-9a-f]{7}\b", context),
        }
        missing = [name for name, found in has.items() if not found]
        if missing:
            problems.append(f"{heading} / table {header[:60]!r}: no {', '.join(missing)}")
    assert not problems, "tables of benchmarks/RESULTS.md without their provenance:\n" + "\n".join(problems)


def test_results_keeps_the_gpu_runbook():
    text = RESULTS.read_text()
    runbook = text.split("## GPU runbook")[1]
    assert "pytest -m gpu" in runbook and "benchmarks/gpu.sh" in runbook


# ---- links between the documents resolve


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_links_between_the_documents_resolve():
    documents = [REPO / "README.md", RESULTS, *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for document in documents:
        for target, anchor in re.findall(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)", document.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path = (document.parent / target).resolve() if target else document
            if not path.exists():
                broken.append(f"{document.relative_to(REPO)}: {target} does not exist")
            elif anchor and path.suffix == ".md":
                anchors = {_slug(line) for line in path.read_text().splitlines() if line.startswith("#")}
                if anchor not in anchors:
                    broken.append(f"{document.relative_to(REPO)}: no heading #{anchor} in {path.relative_to(REPO)}")
    assert not broken, "\n".join(broken)
