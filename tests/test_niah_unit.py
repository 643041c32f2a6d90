"""dsakit.niah without a server process: text, grids, scoring, result files, report, retrieval model, service."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch

from dsakit.niah.client import EndpointConfig, backoff_delay, split_reasoning
from dsakit.niah.grid import parse_depths, parse_lengths, sigmoid_depths
from dsakit.niah.report import (RequestedGrid, cell_lines, found_matrix, grouped_report, needle_line, summary_table,
                                write_heatmap)
from dsakit.niah.results import ResultStore, StoreLockedError, read_rows
from dsakit.niah.retrieval import RetrievalConfig, RetrievalModel, SimpleTokenizer
from dsakit.serve.chat import render_chat
from dsakit.serve.http import FaultConfig, RequestError, check_loopback
from dsakit.serve.reference import ReferenceService
from dsakit.niah.sweep import Calibration, Cell, PromptBuilder, SweepConfig, cell_found, score_needles
from dsakit.niah.text import (CODE_PATTERN, FillerStream, Templates, build_haystack, code_found, completion_prompt,
                              filler_lines, needle_codes, normalize_answer)
from dsakit.niah.tokens import ReferenceCounter, load_counter

LINE_RE = re.compile(r"^  lines=[ \d]{4} depth=\d\.\d\d prompt_tok=[ \d?]{5} found=(True |False|None ) "
                     r"finish=\S+ ans=(['\"]).*\2$")


@pytest.fixture(scope="module")
def service() -> ReferenceService:
    torch.set_num_threads(1)
    return ReferenceService(RetrievalModel(RetrievalConfig()))


# -- text ------------------------------------------------------------------------------------------

def test_filler_lines_are_distinct_reproducible_and_prefix_stable():
    lines = filler_lines(400, seed=3)
    assert len(set(lines)) == 400
    assert filler_lines(400, seed=3) == lines
    assert filler_lines(50, seed=3) == lines[:50]
    assert filler_lines(50, seed=4) != lines[:50]
    assert not any(CODE_PATTERN.search(line) for line in lines)
    words = FillerStream(3).words(37)
    assert sum(len(line.split()) for line in words) == 37
    assert words[:-1] == lines[: len(words) - 1]


def test_templates_refuse_filler_words_and_missing_code():
    Templates().check_filler_is_distinct()
    with pytest.raises(ValueError, match="filler words"):
        Templates(needle="The river code is {code}.").check_filler_is_distinct()
    with pytest.raises(ValueError, match="code"):
        Templates(needle="no placeholder here")


def test_haystack_places_needles_at_depths_and_records_offsets():
    filler = filler_lines(100, seed=0)
    codes = needle_codes(3, seed=1)
    assert len(set(codes)) == 3 and all(CODE_PATTERN.fullmatch(c) for c in codes)
    hay = build_haystack(filler, codes, [0.9, 0.0, 0.5], Templates())
    for code, char in zip(codes, hay.needle_chars):
        assert hay.body[char:].startswith(f"The secret passphrase is {code}.")
    order = sorted(range(3), key=lambda k: hay.needle_chars[k])
    assert order == [1, 2, 0]  # depth 0.0 first, then 0.5, then 0.9
    assert completion_prompt(hay).endswith("Answer:")


def test_normalized_substring_scoring():
    assert normalize_answer(" zebra – 4492 – omega ") == "ZEBRA-4492-OMEGA"
    assert code_found("ZEBRA-4492-OMEGA", "The passphrase is **zebra-4492-omega**.")
    assert not code_found("ZEBRA-4492-OMEGA", "ZEBRA-4493-OMEGA")
    needles = score_needles(["ZEBRA-4492-OMEGA", "TANGO-1111-ECHO"], "ZEBRA-4492-OMEGA", "TANGO-1111-ECHO", "length")
    assert [n["found"] for n in needles] == [True, None]  # cut by a length stop: not scored as a miss
    assert needles[1]["found_in_reasoning"]
    assert cell_found(needles) is None
    assert cell_found(score_needles(["ZEBRA-4492-OMEGA"], "nope", "", "stop")) is False


# -- grids -----------------------------------------------------------------------------------------

def test_length_specs():
    assert parse_lengths("1k,2k,4500") == [1000, 2000, 4500]
    assert parse_lengths("lin:1000:4000:4") == [1000, 2000, 3000, 4000]
    assert parse_lengths("log:1k:8k:4") == [1000, 2000, 4000, 8000]
    assert parse_lengths("range:1000:3500:1000") == [1000, 2000, 3000]
    assert parse_lengths("1K") == [1024]
    for bad in ("", "abc", "lin:1k:2k", "log:2k:1k:3", "0", "range:1:5:0",
                "inf", "log:1k:8k:inf", "lin:1k:nan:3",  # non-finite: ValueError, not OverflowError
                "range:1:1e12:1", "lin:1k:2k:1e9"):  # a typo asking for billions of points fails at once
        with pytest.raises(ValueError):
            parse_lengths(bad)
    with pytest.raises(ValueError, match="finite"):
        parse_depths("lin:nan")


def test_depth_specs():
    assert parse_depths("0.5,0.1") == [0.1, 0.5]
    assert parse_depths("lin:5") == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert parse_depths("lin:0.05:0.95:3") == [0.05, 0.5, 0.95]
    sig = sigmoid_depths(9)
    assert sig[0] == pytest.approx(0.0) and sig[-1] == pytest.approx(1.0) and sig[4] == pytest.approx(0.5)
    assert sig[1] - sig[0] < sig[4] - sig[3]  # denser near the ends
    assert parse_depths("sigmoid:9") == sorted(round(d, 4) for d in sig)
    for bad in ("1.5", "-0.1", "sigmoid:x", "lin:", ""):
        with pytest.raises(ValueError):
            parse_depths(bad)


# -- client helpers --------------------------------------------------------------------------------

def test_reasoning_is_separated_from_the_answer():
    assert split_reasoning("<think>look at entry 3</think>\nZEBRA-4492-OMEGA") == ("ZEBRA-4492-OMEGA", "look at entry 3")
    assert split_reasoning("ZEBRA-4492-OMEGA", "field reasoning") == ("ZEBRA-4492-OMEGA", "field reasoning")
    assert split_reasoning("<think>cut before the end") == ("", "cut before the end")
    assert split_reasoning("thinking without an opening tag</think> ANSWER") == ("ANSWER", "thinking without an opening tag")


def test_backoff_and_endpoint_validation():
    assert backoff_delay(1, 0.5, 30.0, retry_after="2") == 2.0
    assert 0.25 <= backoff_delay(1, 0.5, 30.0) <= 0.5
    assert backoff_delay(20, 0.5, 3.0) <= 3.0
    cfg = EndpointConfig(base_url="http://127.0.0.1:9", model="m")
    assert cfg.url == "http://127.0.0.1:9/v1/chat/completions"
    assert EndpointConfig(base_url="http://h:1/api/v1/", model="m", endpoint="completions").url == \
        "http://h:1/api/v1/completions"
    for kwargs in ({"base_url": "localhost:8000"}, {"endpoint": "responses"}, {"max_tokens": 0}, {"model": ""},
                   {"timeout_s": float("nan")}, {"backoff_s": float("nan")}, {"max_retries": 1.5},
                   {"max_tokens": "5"}):
        with pytest.raises(ValueError):
            EndpointConfig(**{"base_url": "http://h:1", "model": "m", **kwargs})


# -- result store ----------------------------------------------------------------------------------

def test_store_appends_whole_rows_repairs_a_cut_tail_and_refuses_duplicates(tmp_path):
    path = tmp_path / "results.jsonl"
    with ResultStore(path) as store:
        store.append({"cell": "a", "found": True})
        store.append({"cell": "b", "found": False})
        with pytest.raises(ValueError, match="already has a row"):
            store.append({"cell": "a", "found": False})
        with pytest.raises(ValueError, match="cell"):
            store.append({"found": True})
    with open(path, "ab") as fh:
        fh.write(b'{"cell": "c", "fou')  # a write cut by a kill
    with ResultStore(path) as store:
        assert store.repaired_bytes > 0
        assert sorted(store.rows) == ["a", "b"]
        store.append({"cell": "c", "found": True})
    rows, duplicates = read_rows(path)
    assert list(rows) == ["a", "b", "c"] and duplicates == 0
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_store_is_single_writer_and_reports_duplicates_and_bad_lines(tmp_path):
    path = tmp_path / "results.jsonl"
    with ResultStore(path):
        with pytest.raises(StoreLockedError):
            ResultStore(path).open()
    path.write_text('{"cell": "a", "v": 1}\n{"cell": "a", "v": 2}\n')
    rows, duplicates = read_rows(path)
    assert rows["a"]["v"] == 1 and duplicates == 1
    path.write_text('{"cell": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=":2"):
        read_rows(path)
    with pytest.raises(ValueError, match=":2"):
        ResultStore(path).open()
    path.write_text('{"cell": "a"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")  # was an uncaught RecursionError
    with pytest.raises(ValueError, match=":2 is not a JSON row \\(nested too deeply\\)"):
        read_rows(path)
    path.write_text('{"cell": "a"}\n')  # fixed by hand: the failed open above must not hold the lock
    with ResultStore(path) as store:
        assert list(store.rows) == ["a"]


# -- report ----------------------------------------------------------------------------------------

def _row(length, depth, found, finish="stop", answer="ZEBRA-4492-OMEGA", lines=300, tokens=4509):
    return {"cell": f"L{length}-d{depth}", "length": length, "trial": 0, "multi": False, "depths": [depth],
            "lines": lines, "prompt_tokens": tokens, "finish": finish, "answer": answer, "found_count": int(bool(found)),
            "needles": [{"depth": depth, "found": found, "code": "ZEBRA-4492-OMEGA"}]}


def test_cell_line_matches_the_issue_format_exactly():
    row = _row(4500, 0.05, True)
    assert needle_line(row, row["needles"][0]) == \
        "  lines= 300 depth=0.05 prompt_tok= 4509 found=True  finish=stop ans='ZEBRA-4492-OMEGA'"
    assert LINE_RE.match(cell_lines(_row(900, 0.5, False, answer="I don't know"))[0])
    assert LINE_RE.match(cell_lines(_row(900, 0.5, None, finish="length", tokens=None))[0])


def test_summary_table_and_heatmap(tmp_path):
    rows = [_row(1000, 0.05, True), _row(8000, 0.05, False), _row(1000, 0.95, True),
            _row(8000, 0.95, None, finish="length")]
    report = grouped_report(rows)
    assert report[0] == "=== needle at START (depth 0.05), distinct filler, sweep length ==="
    assert any(line.startswith("=== needle at END (depth 0.95)") for line in report)
    table = summary_table(rows, "t")
    lines = table.splitlines()
    row_005 = next(line for line in lines if line.strip().startswith("0.05"))
    assert row_005.split("|")[1].split() == ["100%", "0%"]
    row_095 = next(line for line in lines if line.strip().startswith("0.95"))
    assert row_095.split("|")[1].split() == ["100%", "cut"]
    assert "not scored" in table
    png = write_heatmap(rows, tmp_path / "h.png", "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.pyplot as plt

    open_before = plt.get_fignums()
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):  # a file where the folder should be: savefig fails ...
        write_heatmap(rows, tmp_path / "file" / "h.png", "t")
    assert plt.get_fignums() == open_before  # ... and the figure is closed anyway (pyplot keeps it otherwise)


def test_partial_summary_shows_the_whole_grid_and_counts_missing_cells(tmp_path):
    """Depth 0.50 failed everywhere, 0.95 at 8000 only: the table keeps every requested depth and length, and
    'all' counts the missing needles as not found (it read 100 % from the rows that exist)."""
    rows = [_row(1000, 0.05, True), _row(8000, 0.05, True), _row(1000, 0.95, True)]
    grid = RequestedGrid(lengths=(1000, 8000), depths=(0.05, 0.5, 0.95), trials=1)
    lines = summary_table(rows, "t", grid).splitlines()

    def cells(label):
        row = next(line for line in lines if line.strip().startswith(label))
        return row.split("|")[1].split() + row.split("|")[2].split()

    assert cells("0.05") == ["100%", "100%", "100%"]
    assert cells("0.50") == ["miss", "miss", "miss"]
    assert cells("0.95") == ["100%", "miss", "50%!"]
    assert cells("all") == ["67%!", "33%!", "50%!"]  # 3 found of 6 requested
    assert any(line.startswith("! 3 of 6 requested needle(s) have no row") for line in lines)
    assert summary_table(rows, "t").splitlines()[-1].split("|")[2].split() == ["100%"]  # rows alone: no grid
    assert summary_table([], "t", grid).count(" miss") == (3 + 1) * (2 + 1)  # no row at all: every cell, "all" too


def test_heatmap_marks_cut_and_missing_cells_differently(tmp_path):
    """A cell cut by max_tokens is grey 'cut'; a cell with no row is hatched white 'miss' (both were grey)."""
    import matplotlib.image

    grid = RequestedGrid(lengths=(1000,), depths=(0.5,), trials=1)
    cut = [_row(1000, 0.5, None, finish="length")]
    assert found_matrix(cut, grid)[2][(0.5, 1000)] == (0, 0, 1, 0)
    assert found_matrix([], grid)[2][(0.5, 1000)] == (0, 0, 0, 1)
    grey = []
    for name, rows in (("cut", cut), ("miss", [])):
        pixels = matplotlib.image.imread(write_heatmap(rows, tmp_path / f"{name}.png", "t", grid))[..., :3]
        grey.append(int((abs(pixels - 0xcc / 255) < 0.01).all(-1).sum()))  # the colormap's 'bad' grey
    assert grey[0] > 1000 and grey[1] < grey[0] // 10, grey


# -- retrieval model and service -------------------------------------------------------------------

def test_simple_tokenizer_spans():
    tokens, spans = SimpleTokenizer().tokenize("The code is ZEBRA-4492-OMEGA.")
    assert tokens == ["The", "code", "is", "ZEBRA", "-", "4", "4", "9", "2", "-", "OMEGA", "."]
    assert all("The code is ZEBRA-4492-OMEGA."[a:b] == t for t, (a, b) in zip(tokens, spans))


def test_retrieval_finds_the_needle_and_says_when_it_cannot(service):
    model = service.model
    filler = filler_lines(150, seed=0)
    prompt = completion_prompt(build_haystack(filler, ["TANGO-1234-ECHO"], [0.4], Templates()))
    result = model.retrieve(prompt)
    assert result.answer == "TANGO-1234-ECHO"
    assert {"secret", "passphrase"} <= set(result.query_terms)
    assert result.entries == result.prompt_tokens // 4 and len(result.selected) == model.config.topk
    assert "TANGO-1234-ECHO" in result.trace()
    empty = model.retrieve("\n".join(filler) + "\n\n" + Templates().question)
    assert empty.answer == "I don't know"
    with pytest.raises(ValueError, match="topk"):
        model.retrieve(prompt, topk=0)
    with pytest.raises(ValueError, match="unknown key format"):
        model.retrieve(prompt, key_format="fp6")
    with pytest.raises(ValueError):
        RetrievalConfig(compress_ratio=0)
    for kwargs, field in (({"common_scale": float("nan")}, "common_scale"), ({"topk": True}, "topk"),
                          ({"read_ahead_tokens": 1.5}, "read_ahead_tokens"), ({"rope_scale": "x"}, "rope_scale")):
        with pytest.raises(ValueError, match=field):
            RetrievalConfig(**kwargs)


def test_chat_template_and_question_span():
    prompt, (a, b) = render_chat([{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "long text\n\nWhat is it?"}])
    assert prompt.startswith("<|system|>\nbe brief\n<|user|>\n") and prompt.endswith("<|assistant|>\n")
    assert prompt[a:b] == "long text\n\nWhat is it?"  # the last user message (the reference service takes its
    # last paragraph as the question)
    with pytest.raises(RequestError):
        render_chat([{"role": "system", "content": "no user"}])
    assert check_loopback("localhost") == "127.0.0.1" and check_loopback("::1") == "::1"
    with pytest.raises(ValueError, match="loopback"):
        check_loopback("0.0.0.0")
    with pytest.raises(ValueError):
        FaultConfig(fail_rate=1.5)
    for kwargs, field in (({"latency": float("nan")}, "latency"), ({"latency": float("inf")}, "latency"),
                          ({"fail_rate": "x"}, "fail_rate")):
        with pytest.raises(ValueError, match=field):  # NaN latency used to fail only inside a request thread
            FaultConfig(**kwargs)


def test_service_usage_finish_reason_streaming_and_errors(service):
    filler = filler_lines(40, seed=2)
    content = build_haystack(filler, ["ZEBRA-4492-OMEGA"], [0.5], Templates()).body + "\n\n" + Templates().question
    body = {"model": "dsakit-reference", "messages": [{"role": "user", "content": content}], "max_tokens": 64}
    resp = service.response(body, chat=True)
    choice = resp["choices"][0]
    assert choice["message"]["content"] == "ZEBRA-4492-OMEGA" and choice["finish_reason"] == "stop"
    assert resp["usage"]["prompt_tokens"] == ReferenceCounter().count_chat(content)
    assert resp["usage"]["completion_tokens"] == 8
    cut = service.response({**body, "max_tokens": 3}, chat=True)["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == "ZEBRA-4"
    thinking = service.response({**body, "max_tokens": 500, "dsakit": {"reasoning": "field"}}, chat=True)
    message = thinking["choices"][0]["message"]
    assert message["content"] == "ZEBRA-4492-OMEGA" and "selected entries" in message["reasoning_content"]
    events = service.stream_events({**body, "stream_options": {"include_usage": True},
                                     "dsakit": {"reasoning": "field"}, "max_tokens": 500}, chat=True)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    thought = "".join(e["choices"][0]["delta"].get("reasoning_content") or "" for e in events if e["choices"])
    assert text == "ZEBRA-4492-OMEGA" and thought == message["reasoning_content"]
    assert events[-1]["usage"]["prompt_tokens"] == resp["usage"]["prompt_tokens"]
    completion = service.response({"prompt": content + "\nAnswer:", "max_tokens": 16}, chat=False)
    assert completion["choices"][0]["text"] == "ZEBRA-4492-OMEGA"
    for bad, status in (({**body, "model": "other"}, 404), ({**body, "dsakit": {"topk": 0}}, 400),
                        ({**body, "dsakit": {"index_key_format": "int3"}}, 400), ({**body, "max_tokens": -1}, 400),
                        ({**body, "dsakit": {"colour": 1}}, 400), ({"messages": []}, 400)):
        with pytest.raises(RequestError) as info:
            service.response(bad, chat=True)
        assert info.value.status == status


def test_context_overflow_is_a_400():
    small = ReferenceService(RetrievalModel(RetrievalConfig(max_context=50)))
    with pytest.raises(RequestError, match="maximum context length") as info:
        small.response({"prompt": " ".join(["word"] * 60)}, chat=False)
    assert info.value.status == 400


# -- prompt fitting and token counters --------------------------------------------------------------

def test_fit_with_a_tokenizer_lands_on_the_target():
    counter = ReferenceCounter()
    for endpoint in ("chat", "completions"):
        builder = PromptBuilder(SweepConfig(lengths=(3000,), depths=(0.5,)), endpoint)
        cell = Cell(3000, (0.5,), 0)
        prompt, tokens = builder.fit(cell, counter)
        assert 2990 <= tokens <= 3000
        assert counter.count(prompt.text, endpoint) == tokens
    with pytest.raises(ValueError, match="shorter than the prompt"):
        PromptBuilder(SweepConfig(lengths=(10,), depths=(0.5,)), "chat").fit(Cell(10, (0.5,), 0), counter)


def test_tokenizer_json_counter(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    counter = load_counter(str(path))
    assert counter.count_prompt("the quick brown fox.") == 5  # Whitespace splits the final '.'
    assert load_counter(str(tmp_path)).count_prompt("a b") == 2  # directory: transformers or tokenizer.json
    with pytest.raises(ValueError, match="neither"):
        load_counter(str(tmp_path / "missing.json"))
    bogus = tmp_path / "bogus.json"
    bogus.write_text("not a tokenizer")
    with pytest.raises(ValueError, match="bogus.json"):  # tokenizers raises a bare Exception: the CLI showed a traceback
        load_counter(str(bogus))


def test_transformers_directory_counts_chat_with_its_template(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "<s>": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>")
    fast.chat_template = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant :{% endif %}")
    fast.save_pretrained(str(tmp_path))
    counter = load_counter(str(tmp_path))
    assert counter.counts_chat_template
    assert counter.count("the cat", "completions") == 2
    assert counter.count("the cat", "chat") == 7  # <s> user : the cat assistant :


def test_calibration_line_fit():
    cal = Calibration()
    assert cal.predict_words(1000) == 750
    cal.probes.append({"length": 1000, "words": 750, "chars": 0, "prompt_tokens": 1100})
    assert cal.predict_words(1000) == round(750 * 1000 / 1100)
    cal.probes.append({"length": 1000, "words": 682, "chars": 0, "prompt_tokens": 1000})
    cal.probes.append({"length": 4000, "words": 2000, "chars": 0, "prompt_tokens": 2932})
    assert abs(cal.predict_words(4000) - (682 + 3000 * (2000 - 682) / 1932)) < 15


def test_sweep_config_cells_and_validation():
    cfg = SweepConfig(lengths=(1000, 2000), depths=(0.1, 0.9), trials=2)
    keys = [c.key for c in cfg.cells()]
    assert len(keys) == len(set(keys)) == 8 and "L1000-d0.1000-t1" in keys
    multi = SweepConfig(lengths=(1000,), depths=(0.1, 0.9), multi_needle=True).cells()
    assert [c.key for c in multi] == ["L1000-multi-t0"] and multi[0].depths == (0.1, 0.9)
    for kwargs in ({"lengths": ()}, {"depths": (1.2,)}, {"trials": 0}, {"tolerance": 0.0}, {"concurrency": 0},
                   {"trials": 1.5}, {"concurrency": 2.5}, {"max_calibration_probes": True}):
        with pytest.raises(ValueError):
            SweepConfig(**{"lengths": (1000,), "depths": (0.5,), **kwargs})
    assert SweepConfig(lengths=[1000], depths=[0.5]).lengths == (1000,)


def test_resume_refuses_changed_settings_and_fresh_runs_refuse_old_results(tmp_path):
    from dsakit.niah.sweep import RUN_FILE, check_run_file

    endpoint = EndpointConfig(base_url="http://127.0.0.1:9", model="m")
    fingerprint = SweepConfig(lengths=(1000,), depths=(0.5,)).fingerprint(endpoint, None)
    check_run_file(tmp_path, fingerprint, resume=False)  # empty directory: fine
    (tmp_path / "results.jsonl").write_text('{"cell": "x"}\n')
    with pytest.raises(ValueError, match="--resume"):
        check_run_file(tmp_path, fingerprint, resume=False)
    (tmp_path / RUN_FILE).write_text(json.dumps({"fingerprint": fingerprint}))
    check_run_file(tmp_path, fingerprint, resume=True)
    changed = SweepConfig(lengths=(1000,), depths=(0.5,), seed=7).fingerprint(endpoint, None)
    with pytest.raises(ValueError, match="seed"):
        check_run_file(tmp_path, changed, resume=True)


def test_failed_calibration_is_written_to_errors_jsonl(tmp_path):
    from dsakit.niah.client import Completion
    from dsakit.niah.sweep import ERRORS_FILE, run_sweep

    class NoUsageClient:  # a server whose responses carry no usage.prompt_tokens: calibration cannot work
        def __init__(self, config, concurrency):
            pass

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return None

        async def complete(self, prompt, max_tokens=None):
            return Completion("ZEBRA-1234-OMEGA", "", "stop", None, 1, 1, 0.0)

    config = SweepConfig(lengths=(1000,), depths=(0.5,))
    endpoint = EndpointConfig(base_url="http://127.0.0.1:9", model="m")
    outcome = asyncio.run(run_sweep(config, endpoint, tmp_path, client_factory=NoUsageClient))
    assert outcome.rows == [] and outcome.errors[0]["stage"] == "calibration"
    lines = (tmp_path / ERRORS_FILE).read_text().splitlines()
    assert [json.loads(line)["stage"] for line in lines] == ["calibration"]
    assert "usage.prompt_tokens" in json.loads(lines[0])["error"]


@pytest.mark.parametrize("status,payload,error", [
    (503, {"error": {"message": "busy"}}, "HTTP 503: busy"),
    (200, {"choices": ["not an object"]}, "AttributeError"),  # malformed 200: retried, never crashes the sweep
])
def test_client_gives_up_with_the_last_status_and_survives_malformed_json(monkeypatch, status, payload, error):
    import functools

    import httpx

    from dsakit.niah import client as client_module
    from dsakit.niah.client import EndpointError, OpenAIClient

    calls = []

    def handler(request):
        calls.append(request)
        return httpx.Response(status, json=payload)

    monkeypatch.setattr(client_module.httpx, "AsyncClient",
                        functools.partial(httpx.AsyncClient, transport=httpx.MockTransport(handler)))
    cfg = EndpointConfig(base_url="http://127.0.0.1:9/v1", model="m", max_retries=2, backoff_s=0.0)

    async def go():
        async with OpenAIClient(cfg) as client:
            return await client.complete("hi")

    with pytest.raises(EndpointError, match=error) as info:
        asyncio.run(go())
    assert len(calls) == 3 and info.value.attempts == 3
    assert info.value.status == (503 if status == 503 else None)


def test_http_post_to_an_unknown_route_does_not_desync_keep_alive():
    """A 404 sent before the body is read closes the connection; the body is never parsed as a request."""
    import socket
    import threading

    from dsakit.serve.http import CompletionHTTPServer

    server = CompletionHTTPServer(("127.0.0.1", 0), ReferenceService(RetrievalModel(RetrievalConfig())))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        body = b'GET /health HTTP/1.1\r\nHost: x\r\n\r\n'  # a body that looks like a second request
        request = (b"POST /v1/nope HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        with socket.create_connection(server.server_address[:2], timeout=10) as sock:
            sock.sendall(request)
            received = b""
            while chunk := sock.recv(65536):  # ends when the server closes the connection
                received += chunk
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    assert received.startswith(b"HTTP/1.1 404") and b"Connection: close" in received
    assert received.count(b"HTTP/1.1 ") == 1  # the body was not answered as a request of its own


def test_http_server_drops_a_client_that_stalls_mid_request():
    """A request whose body never arrives must not hold a server thread forever (request_timeout)."""
    import socket
    import threading
    import time

    from dsakit.serve.http import CompletionHTTPServer

    server = CompletionHTTPServer(("127.0.0.1", 0), ReferenceService(RetrievalModel(RetrievalConfig())),
                                 request_timeout=0.5)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        with socket.create_connection(server.server_address[:2], timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            started = time.monotonic()
            assert sock.recv(65536) == b""  # the server closed the connection ...
            assert time.monotonic() - started < 5  # ... after its request timeout, not the client's 10 s
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    with pytest.raises(ValueError, match="request_timeout"):
        CompletionHTTPServer(("127.0.0.1", 0), None, request_timeout=float("nan"))
