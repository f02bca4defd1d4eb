"""The documents: the tree speaks of the project alone, and the facts that can drift across README, guide,
manual and benchmarks/RESULTS.md (preset names, times, figures, each figure's provenance) agree: the documents
quote the demo's figures, and link every other measured figure to its RESULTS section."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from relicv2.evaluation.job import FINETUNE_PRESETS, LINEAR_PRESETS
from relicv2.evaluation.robustness import PRESETS as ROBUSTNESS_PRESETS
from relicv2.evaluation.segment import PRESETS as SEGMENT_PRESETS
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
                "pretrain": PRETRAIN_PRESETS, "eval robustness": ROBUSTNESS_PRESETS,
                "eval segment": SEGMENT_PRESETS}
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
# somewhere, so a reworded sentence fails here instead of silently leaving the check. Only the demo's figures are
# quoted; every other figure is a link to its section (test_the_documents_link_every_throughput_and_ratio_they_quote).
FACTS = [
    ("the demo from a clean clone",
     r"from a clean clone, set-up included \| \*\*(\d+ min \d+ s)\*\*",
     [r"[Ff]rom a clean clone, set-up\s+included, (?:it|`make demo`) took (\d+ min \d+ s)"]),
    ("the demo's pretraining (s)",
     r"pretraining \(240 steps, kNN monitor every 10 epochs\) (\d+) s",
     [r"pretraining \(240\s+steps\) (\d+) s"]),
    ("the demo's kNN top-1",
     r"kNN top-1 \*\*(0\.\d+)\*\* \(random init",
     [r"raised kNN\s+top-1 from 0\.\d+ \(random init\) to (0\.\d+)", r"look past the lighting, (0\.\d+) and"]),
    ("the demo's linear-fast top-1",
     r"linear-fast \*\*(0\.\d+)\*\* \(random init",
     [r"and linear from 0\.\d+ to (0\.\d+)", r"look past the lighting, 0\.\d+ and (0\.\d+)"]),
    ("the demo's random-init kNN top-1",
     r"kNN top-1 \*\*0\.\d+\*\* \(random init (0\.\d+)",
     [r"top-1 from (0\.\d+) \(random init\)", r"score (0\.\d+) and 0\.\d+ on them"]),
    ("the demo's random-init linear-fast top-1",
     r"linear-fast \*\*0\.\d+\*\* \(random init (0\.\d+)",
     [r"and linear from (0\.\d+) to", r"score 0\.\d+ and (0\.\d+) on them"]),
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


def test_results_stays_a_reference():
    """Current figures only, what they replaced in git's history: the file stays short enough to read."""
    lines = RESULTS.read_text().count("\n")
    # ~700 lines hold the figures of the stages and of the evaluation families (robustness, backgrounds,
    # transfer, segmentation, the masking evidence); a new family adds its one reference table.
    assert lines < 760, f"benchmarks/RESULTS.md has {lines} lines: drop superseded rows and narration (git keeps them)"


def test_the_benchmarks_readme_keeps_the_gpu_runbook():
    text = (REPO / "benchmarks" / "README.md").read_text()
    runbook = text.split("## GPU runbook")[1]
    assert "pytest -m gpu" in runbook and "benchmarks/gpu.sh" in runbook


# ---- links between the documents resolve


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_links_between_the_documents_resolve():
    documents = [REPO / "README.md", RESULTS, REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
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


# ---- the documents link a measured figure to its RESULTS section instead of restating it

QUOTING_DOCUMENTS = ("README.md", "docs/guide.md", "docs/operations.md", "docs/design.md")
# A throughput (926 img/s, 1,418 images/s) or a measured ratio (0.34x, 2.3x); counts such as "2x wide" have no
# decimal point and are not ratios of measurements.
BENCHMARK_FIGURE = re.compile(r"\b\d[\d,.]*\s*(?:img|images|samples)/s\b|\b\d+\.\d+x\b")
RESULTS_LINK = re.compile(r"\]\((?:\.\./)?benchmarks/RESULTS\.md#[\w-]+\)")


def _units(text: str) -> list[str]:
    """The sentences of a markdown text, and each table row as one unit; code blocks left out."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    units = []
    for block in re.split(r"\n\s*\n", text):
        rows = [line for line in block.splitlines() if line.startswith("|")]
        prose = " ".join(line for line in block.splitlines() if not line.startswith("|"))
        units += rows + re.split(r"(?<=[.!?])\s+(?=[A-Z`*\[(])", prose)
    return units


def _unlinked_figures(text: str) -> list[str]:
    """Units quoting a benchmark figure without linking its RESULTS section (estimates, marked est., aside)."""
    return [unit for unit in _units(text)
            if BENCHMARK_FIGURE.search(unit) and not RESULTS_LINK.search(unit) and "est." not in unit]


def test_the_figure_check_finds_a_restated_figure_and_spares_a_linked_one():
    restated = "On one H100 the step runs at 1,031 img/s. The rest is prose."
    assert _unlinked_figures(restated) == ["On one H100 the step runs at 1,031 img/s."]
    assert _unlinked_figures("| 4. pretraining | 926 img/s per H100 |")
    assert _unlinked_figures("The pipeline is 0.34x the floor.")
    linked = 'It reaches 0.34x the floor ([RESULTS, "GPU, one H100"](../benchmarks/RESULTS.md#gpu-one-h100)).'
    assert not _unlinked_figures(linked)
    assert not _unlinked_figures("At an assumed 150 images/s per GPU it takes ~9 min (est.).")
    assert not _unlinked_figures("```\nbench 926 img/s\n```\nA ResNet-50 2x wide.")


def test_the_documents_link_every_throughput_and_ratio_they_quote():
    problems = [f"{name}: {unit.strip()[:120]!r}" for name in QUOTING_DOCUMENTS
                for unit in _unlinked_figures((REPO / name).read_text())]
    assert not problems, ("measured figures restated without a link to their RESULTS section (name the section: "
                          '[RESULTS, "Section"](../benchmarks/RESULTS.md#anchor)):\n' + "\n".join(problems))


# A section named in prose or a comment: `RESULTS.md, "Dense CRF cost"`, `[RESULTS, "The demo"](...)`,
# `benchmarks/RESULTS.md ("Saliency network quality")`, and `"Dense CRF cost" and "CRF at inference"`.
SECTION_REFERENCE = re.compile(r'RESULTS(?:\.md)?[,\s(]{1,4}"([^"\n]{1,80})"(?:\s+and\s+"([^"\n]{1,80})")?')


def test_results_sections_named_across_the_tree_exist():
    headings = {line.lstrip("#").strip() for line in RESULTS.read_text().splitlines() if line.startswith("#")}
    missing = []
    for path in _tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary files name no section
        # A name may wrap onto the next line of a comment or a paragraph.
        joined = re.sub(r"\s*\n\s*#?\s*", " ", text)
        missing += [f"{path.relative_to(REPO)}: {name!r}" for match in SECTION_REFERENCE.finditer(joined)
                    for name in filter(None, match.groups()) if name not in headings]
    assert not missing, "sections of benchmarks/RESULTS.md named but absent:\n" + "\n".join(missing)
