"""The contract lives in the repository: docs/contract.md exists and every citation of it in the code names one of
its sections."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_contract_citation_points_into_the_document():
    sections = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "contract.md").read_text(), flags=re.M))
    assert sections == {str(n) for n in range(1, 8)}
    cited = {(path.name, n) for path in (ROOT / "batchgen").rglob("*.py")
             for n in re.findall(r"docs/contract\.md section (\d+)", path.read_text())}
    assert cited and all(n in sections for _, n in cited), cited
    assert not [p for p in (ROOT / "batchgen").rglob("*.py") if "DESIGN section" in p.read_text()]
