"""Sample documents of every kind the rag plugin reads, for extraction and retrieval tests.

Each file is about one unmistakable topic, in several paragraphs, so a paraphrased question
finds the right file. ``FACTS`` lists phrases each file's extracted text must contain
(compare with whitespace collapsed: PDF lines wrap). Keep the content stable: tests depend on it.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

NOTES_TXT = """\
Field notes on lunar tides

The ocean rises and falls twice a day because the Moon's gravity pulls on the near side of the
Earth more strongly than on the far side. The difference stretches the oceans into two tidal
bulges, one facing the Moon and one facing away from it, and the Earth turns beneath them.

Spring tides happen around new moon and full moon, when the Sun, Earth and Moon line up and the
solar pull adds to the lunar one. High tides are then at their highest and low tides at their
lowest. Neap tides come at the quarter moons, when the Sun pulls at right angles to the Moon and
the tidal range is smallest.

The Moon rises about fifty minutes later each day, so each high tide arrives roughly fifty
minutes later than the day before. A complete cycle of two high and two low waters takes
twenty-four hours and fifty minutes, which is called a lunar day.

The shape of a coastline can amplify the tide enormously. In the Bay of Fundy in Canada the
water rises and falls by as much as sixteen metres, because the bay resonates with the tidal
period. Our tide gauge at station KX-12 logged a range of 4.3 metres during the March spring tide.
"""

GUIDE_MD = """\
# Orion-7 Deployment Runbook

This runbook describes how the operations team rolls out a new release of the Orion-7 service
to the production fleet, and what to do when the rollout stops with an error code.

## Prerequisites

Before a rollout, confirm that the release tag is signed, that the staging soak test ran for at
least six hours, and that the on-call engineer has acknowledged the change ticket. Freeze windows
are Friday afternoon and the last week of the quarter: no Orion-7 rollout starts then.

## Rollout

### Canary stage

Deploy to the canary pool first: five percent of the hosts in the eu-west region. Watch the error
budget dashboard for thirty minutes. If the p99 latency grows by more than twenty percent, roll
back with `orionctl rollback --to previous` and open an incident.

### Fleet stage

After a clean canary, promote the release to the rest of the fleet in waves of twenty-five
percent, waiting ten minutes between waves so the health checks can settle.

## Troubleshooting

### ERR-4471: certificate pinning mismatch

The deploy agent refuses to talk to the control plane because the pinned certificate fingerprint
does not match. This usually means the control plane certificate was rotated without updating the
pin bundle. Fetch the new bundle with `orionctl pins refresh`, then restart the deploy agent.

### ERR-5102: quorum lost

The rollout coordinator lost quorum among its three replicas. Do not force the rollout: wait for
the replicas to rejoin, then resume the rollout from the last completed wave.
"""

PAGE_HTML = """\
<!DOCTYPE html>
<html lang="en">
<head>
  <title>A short history of the bicycle</title>
  <style>.hidden-style-marker { color: red; }</style>
  <script>var leaked = "SCRIPT-SHOULD-NOT-APPEAR"; console.log(leaked);</script>
</head>
<body>
  <h1>A short history of the bicycle</h1>
  <p>The ancestor of the bicycle was the <b>running machine</b> built by Karl Drais in Mannheim in
  1817. The rider sat between two wheels and pushed himself along with his feet; the machine had
  no pedals at all, but it proved that a person could balance on two wheels in line.</p>
  <h2>Pedals and the penny-farthing</h2>
  <p>In the 1860s French makers fixed pedals directly to the front wheel. Because one turn of the
  pedals meant one turn of the wheel, builders made front wheels ever larger to go faster, which
  produced the penny-farthing of the 1870s, a fast but dangerous machine from which riders often
  fell head first.</p>
  <h2>The safety bicycle</h2>
  <p>John Kemp Starley's Rover safety bicycle of 1885 had two wheels of similar size and a chain
  driving the rear wheel. Three years later John Boyd Dunlop made the pneumatic tyre practical,
  and the comfortable, safe bicycle set off a cycling craze in the 1890s.</p>
  <h3>Milestones</h3>
  <ul>
    <li>1817: the Drais running machine</li>
    <li>1870s: the high-wheel penny-farthing</li>
    <li>1885: the Rover safety bicycle with chain drive</li>
    <li>1888: the pneumatic tyre</li>
  </ul>
  <noscript>NOSCRIPT-SHOULD-NOT-APPEAR</noscript>
</body>
</html>
"""

REPORT_PDF_PAGES = (
    "Sourdough baking report, page one: the starter.\n\n"
    "A sourdough starter is a culture of wild yeast and lactic acid bacteria kept alive in flour "
    "and water. Our starter, nicknamed Levain Number 9, is fed twice a day with equal weights of "
    "rye flour and water and doubles in about five hours at twenty-four degrees Celsius.\n\n"
    "The dough is mixed at seventy-five percent hydration: seven hundred and fifty grams of water "
    "for every kilogram of flour, with twenty grams of salt and two hundred grams of ripe starter.",

    "Sourdough baking report, page two: shaping and baking.\n\n"
    "After a bulk fermentation of four hours with three sets of stretch and folds, the dough is "
    "shaped into a tight boule and proofed overnight in the refrigerator, which deepens the sour "
    "flavour.\n\n"
    "The loaf is baked in a preheated cast iron Dutch oven at two hundred and fifty degrees Celsius "
    "for twenty minutes with the lid on, then for another twenty-five minutes with the lid off, "
    "until the crust is deep brown and the loaf sounds hollow when tapped.",
)

MEMO_TITLE = "Honeybee Colony Memo"
MEMO_PARAGRAPHS = (
    ("Heading 1", "Colony structure"),
    (None, "A honeybee colony has a single queen, a few hundred drones in summer and tens of "
           "thousands of sterile female workers. The queen can lay up to two thousand eggs a day "
           "during the spring build-up."),
    (None, "Workers change jobs as they age: young bees clean cells and feed larvae, middle-aged "
           "bees build comb and guard the entrance, and the oldest bees forage for nectar and pollen."),
    ("Heading 1", "Winter survival"),
    (None, "In winter the colony forms a tight cluster around the queen. The bees shiver their "
           "flight muscles to generate heat and keep the centre of the cluster near thirty-five "
           "degrees Celsius, slowly eating the honey stored in autumn."),
    ("Heading 2", "Hive inspection results"),
    (None, "The apiary inspection found hive HIVE-B7 queenless; a new mated queen was introduced "
           "in a cage with a candy plug so the workers could accept her scent over three days."),
)
MEMO_TABLE = (("Hive", "Frames of brood", "Queen seen"),
              ("HIVE-A3", "8", "yes"),
              ("HIVE-B7", "0", "no"))

TOOL_PY = '''\
"""A small CSV parser that understands quoted fields."""

from __future__ import annotations

DELIMITER = ","
QUOTE = '"'


def parse_csv_line(line: str) -> list[str]:
    """Split one CSV line into fields.

    A field wrapped in double quotes may contain commas; a doubled quote inside a
    quoted field stands for one literal quote character.
    """
    fields, current, quoted, i = [], [], False, 0
    while i < len(line):
        char = line[i]
        if quoted and char == QUOTE and line[i + 1:i + 2] == QUOTE:
            current.append(QUOTE)
            i += 1
        elif char == QUOTE:
            quoted = not quoted
        elif char == DELIMITER and not quoted:
            fields.append("".join(current))
            current = []
        else:
            current.append(char)
        i += 1
    fields.append("".join(current))
    return fields


def read_records(text: str) -> list[dict[str, str]]:
    """Parse CSV text whose first line is the header into one dict per row."""
    lines = [line for line in text.splitlines() if line.strip()]
    header = parse_csv_line(lines[0])
    return [dict(zip(header, parse_csv_line(line))) for line in lines[1:]]


class CsvSummary:
    """Counts rows and blank cells of parsed records, for a quick data-quality report."""

    def __init__(self, records: list[dict[str, str]]) -> None:
        self.rows = len(records)
        self.blank_cells = sum(1 for row in records for value in row.values() if not value)
'''

#: Phrases each file's extracted text contains (whitespace collapsed).
FACTS: dict[str, tuple[str, ...]] = {
    "notes.txt": ("Spring tides happen around new moon and full moon", "Bay of Fundy", "station KX-12"),
    "guide.md": ("ERR-4471: certificate pinning mismatch", "orionctl pins refresh", "ERR-5102"),
    "page.html": ("Karl Drais", "penny-farthing", "John Kemp Starley", "1888: the pneumatic tyre"),
    "report.pdf": ("Levain Number 9", "seventy-five percent hydration",
                   "two hundred and fifty degrees Celsius"),
    "memo.docx": ("Honeybee Colony Memo", "tight cluster around the queen", "HIVE-B7"),
    "tool.py": ("def parse_csv_line(line: str) -> list[str]:", "class CsvSummary:", "doubled quote"),
}


def write_samples(folder: Path) -> dict[str, Path]:
    """Write the six sample files into ``folder``; file name → path."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {name: folder / name for name in FACTS}
    paths["notes.txt"].write_text(NOTES_TXT, encoding="utf-8")
    paths["guide.md"].write_text(GUIDE_MD, encoding="utf-8")
    paths["page.html"].write_text(PAGE_HTML, encoding="utf-8")
    paths["tool.py"].write_text(TOOL_PY, encoding="utf-8")
    write_pdf(paths["report.pdf"], REPORT_PDF_PAGES)
    _write_memo(paths["memo.docx"])
    return paths


def write_pdf(path: Path, pages: tuple[str, ...]) -> None:
    """A PDF with one page per string (Helvetica, so Latin-1 text only); blank lines start paragraphs."""
    from fpdf import FPDF
    from fpdf.enums import XPos, YPos

    pdf = FPDF()
    pdf.set_creation_date(datetime(2024, 1, 1, tzinfo=timezone.utc))
    pdf.set_font("Helvetica", size=12)
    for page in pages:
        pdf.add_page()
        for paragraph in page.split("\n\n"):
            pdf.multi_cell(0, 7, paragraph, new_x=XPos.LMARGIN, new_y=YPos.NEXT)
            pdf.ln(4)
    pdf.output(str(path))


def _write_memo(path: Path) -> None:
    import docx

    document = docx.Document()
    document.add_paragraph(MEMO_TITLE, style="Title")
    for style, text in MEMO_PARAGRAPHS:
        if style:
            document.add_heading(text, level=int(style.split()[1]))
        else:
            document.add_paragraph(text)
    table = document.add_table(rows=0, cols=len(MEMO_TABLE[0]))
    for row in MEMO_TABLE:
        for cell, value in zip(table.add_row().cells, row):
            cell.text = value
    document.save(str(path))
