"""The steered server's parts without a server: a reply built token by token (what it holds back,
where it stops) and the batcher's grouping of waiting requests."""

from __future__ import annotations

import threading

import pytest

from lit_interventions.serving.batcher import Batcher, Job
from lit_interventions.serving.completion_request import Sampling, Steering
from lit_interventions.serving.reply_stream import EVENT_DONE, EVENT_TEXT, Reply


def test_a_reply_holds_back_what_a_stop_or_a_split_character_may_change():
    pieces = {1: "He", 2: "llo", 3: " wo", 4: "r", 5: "ld", 6: "\ufffd"}
    events = []
    reply = Reply(lambda ids: "".join(pieces[i] for i in ids), limit=10, eos=(0,), stops=("wor!",), emit=events.append)
    for token in (1, 2, 3, 4, 5, 6):
        reply.push(token)
    assert events == [(EVENT_TEXT, t) for t in ("He", "llo", " ", "world")]  # "wo", "wor" and "\ufffd" held
    reply.push(0)  # EOS: what was held goes out, and the reply ends
    assert events[-2:] == [(EVENT_TEXT, "\ufffd"), (EVENT_DONE, "stop")]
    assert reply.tokens == [1, 2, 3, 4, 5, 6, 0] and reply.done
    events.clear()
    cut = Reply(lambda ids: "".join(pieces[i] for i in ids), limit=10, stops=("ld",), emit=events.append)
    for token in (1, 2, 3, 4, 5, 1):
        cut.push(token)
    assert cut.text == "Hello wor" and cut.finish == "stop"
    assert events == [(EVENT_TEXT, t) for t in ("He", "llo", " wo", "r")] + [(EVENT_DONE, "stop")]
    assert cut.tokens == [1, 2, 3, 4, 5]  # tokens after the end are ignored


def test_the_batcher_groups_by_sampling_up_to_max_batch():
    seen, ran = [], threading.Event()

    def run(jobs):
        seen.append([job.ids[0] for job in jobs])
        if len(seen) == 3:
            ran.set()

    batcher = Batcher(run, max_batch=3, wait=0.3)
    greedy, sampled = Sampling(), Sampling(True, 0.7, 0.9)
    for k, sampling in enumerate([greedy, sampled, greedy, greedy, greedy]):
        batcher.submit(Job([k], sampling, Steering(), Reply(str, limit=1)))
    assert ran.wait(10)
    batcher.close()
    assert seen == [[0, 2, 3], [1], [4]]  # the oldest's group: full at once; then by age
    assert batcher.batches == 3
    with pytest.raises(ValueError, match="max_batch=0 must be an integer >= 1"):
        Batcher(run, max_batch=0)
