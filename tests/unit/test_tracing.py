"""Reading the span files while the servers still write them."""

import json

from orchestrator.tracing import read_spans


def test_a_line_still_being_written_is_left_for_the_next_read(tmp_path):
    done = {"name": "decode", "trace_id": "1"}
    torn = json.dumps({"name": "prefill", "trace_id": "1"})[:20]
    (tmp_path / "decode.jsonl").write_text(json.dumps(done) + "\n" + torn, encoding="utf-8")
    (tmp_path / "front.jsonl").write_text("", encoding="utf-8")
    assert read_spans(tmp_path) == [done]
    (tmp_path / "decode.jsonl").write_text(json.dumps(done) + "\n" + json.dumps(done) + "\n")
    assert read_spans(tmp_path) == [done, done]
