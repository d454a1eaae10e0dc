"""An engine driven as a server drives it: requests arrive while others run, and some are aborted mid-way."""


def run_workload(engine, work: list[tuple], rng, abort_probability: float, check=lambda: None) -> tuple[dict, set]:
    """work: (request id, prompt, params, may be aborted) tuples, added 0 to 3 a step in order, not streaming (the
    one delta of each holds its whole output); each step a request that may be aborted is, with abort_probability;
    `check` runs after every step. Returns (the last delta of each finished request by id, the aborted ids)."""
    finished, aborted, pending = {}, set(), list(work)
    steps = 0
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):  # requests arrive while others run
            if pending:
                req_id, prompt, params, _ = pending.pop(0)
                engine.add_request(req_id, prompt, params, stream=False)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        for req_id, _, _, abort in work:
            if abort and req_id in engine.groups and rng.random() < abort_probability:
                engine.abort_request(req_id)
                aborted.add(req_id)
        check()
        steps += 1
        assert steps < 2000, "the workload did not finish"
    return finished, aborted
