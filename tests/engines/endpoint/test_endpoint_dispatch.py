"""The endpoint dispatcher's scheduling on its own (engines/endpoint/dispatch.py), with a send function standing in
for one HTTP attempt (the engine against a real server: test_engine_openai.py): runs on one dispatcher never see
each other's attempts, a request that keeps failing while others are answered is its own error row, a server that
answers nothing stops the job, and a Retry-After with nothing in flight is waited out, not taken for a starved
source."""

from __future__ import annotations

import threading
import time

import pytest

from batchgen.engines.endpoint.dispatch import Dispatcher, EndpointDown, Outcome
from batchgen.records import Request, Result
from batchgen.sampling import SampleParams

PARAMS = SampleParams(max_new_tokens=4, temperature=0.0, top_p=1.0, top_k=0, stop=(), ignore_eos=False)


def requests(keys, tag: int) -> list[Request]:
    return [Request(key=k, prompt_ids=[tag, k], params=PARAMS, seed=None) for k in keys]


def answer(req: Request) -> Outcome:
    return Outcome(result=Result(key=req.key, text=f"{req.prompt_ids}", finish_reason="stop", num_prompt_tokens=2,
                                 num_generated_tokens=1))


def once(batch: list[Request]):
    given = [False]

    def source():
        if given[0]:
            return None
        given[0] = True
        return batch

    return source


def test_an_attempt_of_a_stopped_run_never_lands_in_the_next_run():
    release = threading.Event()

    def send(req: Request) -> Outcome:
        if req.prompt_ids[0] == 1 and req.key == 0:
            release.wait(5)  # in flight when the first run stops
        return answer(req)

    dispatcher = Dispatcher(send, most=4, max_retries=0, stop_grace_s=0.0)
    got: list[Result] = []

    def stop_at_first(result: Result) -> None:
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError):
        dispatcher.run(once(requests([0, 1], tag=1)), stop_at_first)
    release.set()
    time.sleep(0.1)  # the first run's attempt of key 0 finishes now
    dispatcher.run(once(requests([0, 1, 2], tag=2)), got.append)
    assert sorted((r.key, r.text) for r in got) == [(0, "[2, 0]"), (1, "[2, 1]"), (2, "[2, 2]")]
    dispatcher.close()


def test_a_request_that_keeps_failing_while_others_are_answered_is_an_error_row():
    def send(req: Request) -> Outcome:
        if req.key == 3:
            return Outcome(transient="HTTP 500")
        time.sleep(0.01)
        return answer(req)

    dispatcher = Dispatcher(send, most=2, max_retries=2, stop_grace_s=1.0)
    got: list[Result] = []
    dispatcher.run(once(requests(range(40), tag=0)), got.append)
    by_key = {r.key: r for r in got}
    assert len(by_key) == 40 and by_key[3].finish_reason == "error"
    assert by_key[3].error == "endpoint_failed: 3 attempts, the last: HTTP 500"
    dispatcher.close()


def test_a_server_that_answers_nothing_stops_the_run():
    dispatcher = Dispatcher(lambda req: Outcome(transient="ConnectError"), most=2, max_retries=1, stop_grace_s=0.1)
    with pytest.raises(EndpointDown, match="with no other answer meanwhile"):
        dispatcher.run(once(requests(range(3), tag=0)), lambda r: None)
    dispatcher.close()


def test_a_retry_after_with_nothing_in_flight_is_waited_out():
    dispatcher = Dispatcher(answer, most=2, max_retries=0, stop_grace_s=0.1)
    dispatcher.window.hold_until = time.monotonic() + 0.3  # a 429's Retry-After from an earlier run
    got: list[Result] = []
    start = time.monotonic()
    dispatcher.run(once(requests(range(3), tag=0)), got.append)
    assert len(got) == 3 and time.monotonic() - start >= 0.25
    dispatcher.close()
