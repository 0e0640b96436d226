"""The HTML report (client/report_html.py): one self-contained page, every user string escaped, failed and
retried attempts marked, withheld records counted, a bounded timeline for 10,000 attempts; and a real local
job's page as Chromium draws it (a screenshot that is not blank, a DOM that shows the task count)."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from records import ESTIMATE, record

from shardfold.client.report_html import LANE_LIMIT, render
from shardfold.functions.report import build

CHROMIUM = "/usr/bin/chromium"
WAIT_S = 300  # a deadline, not a timing assumption


def synthetic_doc() -> dict:
    records = [
        record("prep", None, 0, 101.0, 0.2),
        record("work", 0, 0, 101.5, 1.0, outcome="failed", error={"type": "OSError", "message": "flaky"}),
        record("work", 0, 1, 102.6, 1.0, peak_memory_mib=80.0),  # the retry
        record(
            "work", 1, 0, 101.5, 2.0, outcome="failed", error={"type": "ValueError", "message": "<b>x</b>"}
        ),
        record("work", 2, 0, None, None, withheld=True, peak_memory_mib=None, requests={}),  # private figures
    ]
    status = {
        "job_id": "job-<i>1</i>",
        "kind": "k",
        "state": "FAILED",
        "error": "step <work> failed & stopped",
    }
    return build(
        ESTIMATE, records, status, batch_steps=set(), allowed={"work": 2}, deadline_s=3.0, submitted_at=100.0
    )


def self_contained(page: str) -> None:
    low = page.lower()
    for ref in ("http://", "https://", "<script", "<link", "<img", "<iframe", "@import", "url(http"):
        assert ref not in low, ref


def test_the_page_is_self_contained_marks_failures_and_retries_and_escapes_user_strings():
    doc = synthetic_doc()
    page = render(doc)
    self_contained(page)
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "4 tasks (5 attempts)" in page  # the withheld attempt is a task too
    # user strings arrive escaped, never as markup
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page
    assert "job-&lt;i&gt;1&lt;/i&gt;" in page and "<i>1</i>" not in page
    assert "step &lt;work&gt; failed &amp; stopped" in page
    assert "the &lt;item&gt; list" in page and "a note" in page  # the estimator's reasons
    # one bar per timed attempt; the failed ones outlined red, the retry hatched and dotted
    bars = re.findall(r'<g class="([^"]*)"><rect ', page)
    assert len(bars) == 4
    assert sum("failed" in c for c in bars) == 2 and sum("retry" in c for c in bars) == 1
    assert page.count('class="mark-failed"') == 2 and page.count('class="mark-retry"') == 1
    assert 'fill="url(#hatch)"' in page and 'stroke="#d62728"' in page
    assert "✕ failed" in page
    # the tooltip names step, task, attempt, duration, peak and error
    tip = re.search(r"<title>(step work\ntask 0, attempt 1 \(retry\)[^<]*)</title>", page)
    assert tip and "duration 1.000 s" in tip.group(1) and "peak 80.0 MiB" in tip.group(1)
    assert "error ValueError: &lt;b&gt;x&lt;/b&gt;" in page
    assert "1 attempt(s) not drawn: their figures are withheld" in page
    # the header: cost, SLA, responsiveness, scaling
    assert "SLA missed" in page and "3 s deadline" in page
    assert "first task ran after 1.00 s" in page and "at most 2 tasks at once" in page
    # the CLI's tables, the memory and cost charts
    for title in ("plan (at submit)", "actual", "cost (USD, us-east-1 list prices)"):
        assert f"<h3>{title}</h3>" in page
    assert "<td>80/1,024</td>" in page  # work's measured peak against its memory, as the CLI prints it
    assert "Memory per task (MiB)" in page and "projected peak 300 MiB" in page
    assert "lambda_compute" in page and "$0.500000" in page


def test_a_job_without_an_estimate_or_records_still_renders():
    doc = build(
        None, [], {"job_id": "j", "kind": "getbatch", "state": "FAILED", "error": None}, batch_steps=set()
    )
    page = render(doc)
    self_contained(page)
    assert "0 tasks (0 attempts)" in page and "No timed task attempts" in page
    # and a bare document with hardly anything in it
    page = render({"job_id": None, "records": [{"step": "s", "started_at": 5.0, "outcome": "running"}]})
    assert "Job -" in page and "1 attempt(s) drawn" in page


def test_ten_thousand_attempts_render_in_bounded_rows():
    records = [
        record("work", i, 0, 1000.0 + (i % 500) * 0.01 + (i // 500) * 2.0, 1.5 + (i % 7) * 0.1)
        for i in range(10_000)
    ]
    records[17] |= {"outcome": "failed", "error": {"type": "E", "message": "boom"}}
    records.append(record("work", 17, 1, 1100.0, 1.0))
    estimate = {**ESTIMATE, "steps": ESTIMATE["steps"][1:]}
    doc = build(estimate, records, {"job_id": "big", "kind": "k", "state": "SUCCEEDED"}, batch_steps=set())
    started = time.perf_counter()
    page = render(doc)
    assert time.perf_counter() - started < 10
    self_contained(page)
    timeline = re.search(r'<svg width="\d+" height="([\d.]+)"[^>]*aria-label="task timeline"', page)
    assert float(timeline[1]) < 700  # at most LANE_LIMIT rows of a few px each
    assert page.count('<g class="') == 10_001 and page.count('class="mark-failed"') == 1
    assert f"lanes folded onto {LANE_LIMIT}" in page and len(page) < 5_000_000


# --- in a browser -------------------------------------------------------------------------------------------


def png_pixels(data: bytes) -> np.ndarray:
    """The pixels of an 8-bit, non-interlaced RGB or RGBA PNG (what Chromium writes) as a (h, w, channels)
    array: zlib and the PNG filters, no imaging library."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, [], None
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, header
    bpp = 3 if colour == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8).reshape(height, 1 + width * bpp)
    out = np.zeros((height, width * bpp), dtype=np.uint8)
    prev = np.zeros(width * bpp, dtype=np.int64)
    for y in range(height):
        f, line = raw[y, 0], raw[y, 1:].astype(np.int64)
        if f == 0:
            cur = line
        elif f == 1:  # Sub: a running sum along each channel
            cur = np.cumsum(line.reshape(width, bpp), axis=0).reshape(-1) % 256
        elif f == 2:  # Up
            cur = (line + prev) % 256
        else:  # Average, Paeth: sequential within the row
            cur_l, line_l, up = [0] * (width * bpp), line.tolist(), prev.tolist()
            for i in range(width * bpp):
                a = cur_l[i - bpp] if i >= bpp else 0
                if f == 3:
                    cur_l[i] = (line_l[i] + (a + up[i]) // 2) & 255
                else:
                    b, c = up[i], up[i - bpp] if i >= bpp else 0
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
                    cur_l[i] = (line_l[i] + pred) & 255
            cur = np.array(cur_l, dtype=np.int64)
        out[y], prev = cur, cur
    return out.reshape(height, width, bpp)


def chromium(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    profile = tmp_path / f"chromium-profile-{len(list(tmp_path.glob('chromium-profile-*')))}"
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}",
    ]  # fmt: skip
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=180, check=False)


@pytest.mark.slow
def test_chromium_draws_a_real_jobs_report(tmp_path, monkeypatch):
    if not Path(CHROMIUM).exists() or not shutil.which(CHROMIUM):
        pytest.skip(
            f"{CHROMIUM} is missing: install Debian's `chromium` package (apt-get install -y chromium)"
        )
    from shardfold.client import Client
    from shardfold.functions import store

    monkeypatch.setenv("SHARDFOLD_HOME", str(tmp_path / "home"))
    with Client() as c:
        for i in range(6):
            store.put(c.uri(f"d/o{i}"), bytes([65 + i]) * (100 * (i + 1)))
        spec = {"kind": "getbatch", "items": [{"uri": f"d/o{i}"} for i in range(6)], "items_per_part": 2}
        job = c.submit({**spec, "deadline_s": 600})
        assert job.wait(progress=False, timeout_s=WAIT_S).state == "SUCCEEDED"
        doc = job.report()
    assert doc["tasks"] == 5  # prepare, 3 parts, assemble
    html_path = tmp_path / "report.html"
    html_path.write_text(render(doc))
    self_contained(html_path.read_text())

    png = tmp_path / "report.png"
    run = chromium(["--window-size=1200,1600", f"--screenshot={png}", html_path.as_uri()], tmp_path)
    assert png.exists(), run.stderr[-2000:]
    pixels = png_pixels(png.read_bytes())[:, :, :3]
    assert pixels.shape[:2] == (1600, 1200)
    colours = np.unique(pixels.reshape(-1, 3), axis=0)
    not_white = np.any(pixels < 245, axis=2).mean()
    assert len(colours) > 50 and not_white > 0.02, (len(colours), not_white)

    dom = chromium(["--dump-dom", html_path.as_uri()], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "5 tasks (5 attempts)" in dom.stdout and job.job_id in dom.stdout
    assert dom.stdout.count('class="attempt"') == 5 and "<svg" in dom.stdout
