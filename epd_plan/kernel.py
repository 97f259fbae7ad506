"""The discrete-event simulation of one fleet, compiled with numba.

Everything here works on flat arrays so that numba can compile it; ``simulate.py`` builds
those arrays from the planner's dataclasses and reads the results back. The model:

- Requests arrive as a Poisson stream and are sampled here (so an hour at 10,000 req/s
  needs no request arrays): a share carries images, each of a resolution drawn from a mix;
  the prompt and output lengths are fixed or geometric.
- **Encode pool**: ``servers`` parallel servers behind one FIFO queue (the front's
  least-outstanding routing over encoders that answer first come, first served). A
  request's service time is the call's base cost plus, per image, a per-image cost and a
  per-megapixel cost: those of the tower's pass, or the smaller ones of decoding an image
  the pool's cache holds; deterministic, or exponential with that mean. The cache is the
  pool's (routing sends an image to the encoder that holds it, so the encoders' caches act
  as one): FIFO eviction over ``cache_entries`` images.
- **Engine pools** (vLLM engines: ``aggregated``, ``pd``, ``prefill``, ``decode``): each
  replica runs steps like vLLM's scheduler. A step decodes one token for every running
  sequence and prefills waiting prompts first come first served within a token budget
  (chunked prefill); it lasts ``base + per_token * prefill tokens + per_seq * running +
  per_kctx * running context / 1000`` seconds, plus what a step carrying prefill costs
  beyond a decode-only one, plus each request's own fixed cost (and the vision tower inside
  an ``aggregated`` engine, per image) on the step that starts its prefill.
  A request joins the replica with the fewest requests (running and waiting), as the
  front's router does.
- A decode engine (E/P/D) takes the prompt's KV from prefill and makes every output token
  itself, the first one included, as vLLM's disaggregated prefill does. With conditional
  disaggregation (``local_prefill_tokens`` > 0) a prompt of at most that many tokens, its
  images' included, skips prefill: it joins the decode pool straight from the front (or
  from its encode), pulls its images there and is prefilled in decode's own steps, as the
  front routes it once its images are encoded.
- Fixed delays between hops: the stage calls' overhead measured by the traces, pulling each
  image's embeddings, and the KV transfer from prefill to decode.
- On one host (``one_host``) the encoder's pass, the engines' steps and the serving path
  share the cores: each hop's delay is also work of a serving job (the stages' Python, the
  front's relay: one thread), so a request's hops slow the steps of the others as they do
  on a real box. An engine's step wants every core (its OpenMP threads), the encoder's
  pass as many as it was measured to keep busy, the serving path one; when together they
  want more than the box has, every busy job slows alike.

Times and sizes are float64 seconds and int64 counts; results are histograms.
"""

from __future__ import annotations

import numba
import numpy as np

# Event kinds.
ARRIVE = 0
ENCODE_JOIN = 1
ENCODE_DONE = 2
ENTER_POOL = 3
STEP_END = 4
HOST_STEP_END = 5  # a step on a shared host: (pool, generation); stale ones are dropped

# Engine pool roles.
ROLE_FULL = 0  # prefill and decode in one engine (aggregated, pd)
ROLE_PREFILL = 1  # prefill only: the request moves on to the decode pool
ROLE_DECODE = 2  # decode only: the request arrives with its first token

# Indices of ``pool_params`` columns.
P_REPLICAS = 0
P_ROLE = 1
P_BUDGET = 2  # token budget of a step (max_num_batched_tokens)
P_MAX_SEQS = 3  # sequences a replica holds at once (max_num_seqs)
P_BASE = 4
P_PER_TOKEN = 5
P_PER_SEQ = 6
P_PER_KCTX = 7
P_ENTER_DELAY = 8  # from the previous stage's end to joining this pool
P_EXTRA_PER_IMAGE = 9  # engine time per image on the step its prefill starts
P_PER_REQUEST = 10  # engine time per request on the step its prefill starts
P_PULL_PER_IMAGE = 11  # per image, before joining: pulling its embeddings
P_PREFILL_STEP = 12  # what a step carrying prefill tokens costs beyond a decode-only step
P_COLUMNS = 13

# Rows of the shared host's ``jobs`` array (one column per job).
J_ACTIVE = 0  # 1.0 while the job has work
J_LEFT = 1  # seconds of work left at full speed
J_GEN = 2  # generation of its scheduled end (older end events are stale)
J_WIDTH = 3  # cores it keeps busy
J_ROWS = 4

# Result histograms: log-spaced bins from 1 us to ~1e4 s.
HIST_BINS = 2400
HIST_LO = 1e-6
HIST_PER_DECADE = 240.0

# Indices of the ``counters`` result.
C_ARRIVED = 0
C_COMPLETED = 1
C_MEASURED = 2
C_IMAGES = 3
C_HITS = 4
C_MAX_INFLIGHT = 5
C_OVERFLOW = 6  # 1 when in-flight requests exceeded the slots: the fleet cannot keep up
C_EVENTS = 7
C_LOCAL = 8  # measured requests prefilled by decode (conditional disaggregation)
C_COLUMNS = 9


@numba.njit(cache=True, error_model="numpy")
def _bin(value: float) -> int:
    if value <= HIST_LO:
        return 0
    b = int(np.log10(value / HIST_LO) * HIST_PER_DECADE)
    return min(b, HIST_BINS - 1)


@numba.njit(cache=True, error_model="numpy")
def _push(ev_t, ev_v, ev_n, t, kind, a, b):
    """Add an event to the queue: a binary min-heap on (time, packed kind/a/b) in arrays,
    sized for the most events that can be pending (one per request and per replica, and
    the shared host's stale ends); numba does not check bounds, so this does."""
    i = ev_n[0]
    if i >= ev_t.shape[0]:
        raise IndexError("event queue full")
    ev_n[0] = i + 1
    v = (np.int64(kind) << 59) | (np.int64(a) << 24) | np.int64(b)
    while i > 0:
        parent = (i - 1) >> 1
        pt = ev_t[parent]
        if pt < t or (pt == t and ev_v[parent] <= v):
            break
        ev_t[i] = pt
        ev_v[i] = ev_v[parent]
        i = parent
    ev_t[i] = t
    ev_v[i] = v


@numba.njit(cache=True, error_model="numpy")
def _pop(ev_t, ev_v, ev_n):
    """The earliest event as (time, kind, a, b)."""
    t0 = ev_t[0]
    v0 = ev_v[0]
    n = ev_n[0] - 1
    ev_n[0] = n
    t = ev_t[n]
    v = ev_v[n]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and (
            ev_t[child + 1] < ev_t[child]
            or (ev_t[child + 1] == ev_t[child] and ev_v[child + 1] < ev_v[child])
        ):
            child += 1
        if t < ev_t[child] or (t == ev_t[child] and v <= ev_v[child]):
            break
        ev_t[i] = ev_t[child]
        ev_v[i] = ev_v[child]
        i = child
    ev_t[i] = t
    ev_v[i] = v
    return t0, v0 >> 59, (v0 >> 24) & ((np.int64(1) << 35) - 1), v0 & ((np.int64(1) << 24) - 1)


@numba.njit(cache=True, error_model="numpy")
def _add_load(heap_key, heap_rep, pos, pool, count, replica, delta, t, seq_s, present, last):
    """Add ``delta`` to a replica's load (its requests, running or waiting) in its pool's
    indexed min-heap (``count`` replicas) and restore the heap order: the root is always the
    least loaded replica. Also integrates the pool's requests present over time."""
    seq_s[pool] += present[pool] * (t - last[pool])
    present[pool] += delta
    last[pool] = t
    i = pos[pool, replica]
    heap_key[pool, i] += delta
    if delta < 0:  # sift up
        while i > 0:
            parent = (i - 1) // 2
            if heap_key[pool, parent] <= heap_key[pool, i]:
                break
            _swap(heap_key, heap_rep, pos, pool, i, parent)
            i = parent
    else:  # sift down
        while True:
            child = 2 * i + 1
            if child >= count:
                break
            if child + 1 < count and heap_key[pool, child + 1] < heap_key[pool, child]:
                child += 1
            if heap_key[pool, i] <= heap_key[pool, child]:
                break
            _swap(heap_key, heap_rep, pos, pool, i, child)
            i = child


@numba.njit(cache=True, error_model="numpy")
def _swap(heap_key, heap_rep, pos, pool, i, j):
    ki = heap_key[pool, i]
    ri = heap_rep[pool, i]
    heap_key[pool, i] = heap_key[pool, j]
    heap_rep[pool, i] = heap_rep[pool, j]
    heap_key[pool, j] = ki
    heap_rep[pool, j] = ri
    pos[pool, heap_rep[pool, i]] = i
    pos[pool, heap_rep[pool, j]] = j


@numba.njit(cache=True, error_model="numpy")
def _run_push(run_key, run_req, run_size, replica, key, req):
    i = run_size[replica]
    run_size[replica] = i + 1
    run_key[replica, i] = key
    run_req[replica, i] = req
    while i > 0:
        parent = (i - 1) // 2
        if run_key[replica, parent] <= run_key[replica, i]:
            break
        k = run_key[replica, parent]
        r = run_req[replica, parent]
        run_key[replica, parent] = run_key[replica, i]
        run_req[replica, parent] = run_req[replica, i]
        run_key[replica, i] = k
        run_req[replica, i] = r
        i = parent


@numba.njit(cache=True, error_model="numpy")
def _run_pop(run_key, run_req, run_size, replica):
    top = run_req[replica, 0]
    n = run_size[replica] - 1
    run_size[replica] = n
    run_key[replica, 0] = run_key[replica, n]
    run_req[replica, 0] = run_req[replica, n]
    i = 0
    while True:
        left = 2 * i + 1
        if left >= n:
            break
        child = left
        if left + 1 < n and run_key[replica, left + 1] < run_key[replica, left]:
            child = left + 1
        if run_key[replica, i] <= run_key[replica, child]:
            break
        k = run_key[replica, child]
        r = run_req[replica, child]
        run_key[replica, child] = run_key[replica, i]
        run_req[replica, child] = run_req[replica, i]
        run_key[replica, i] = k
        run_req[replica, i] = r
        i = child
    return top


@numba.njit(cache=True, error_model="numpy")
def _host_speed(jobs, cores):
    """How fast every busy job on the shared host runs: all of them at full speed while
    their threads fit the cores, else all slowed alike to share them."""
    wanted = 0.0
    for k in range(jobs.shape[1]):
        wanted += jobs[J_ACTIVE, k] * jobs[J_WIDTH, k]
    return 1.0 if wanted <= cores else cores / wanted


@numba.njit(cache=True, error_model="numpy")
def _host_change(t, job, work, more, jobs, host, ev_t, ev_v, ev_n):
    """On the shared host, ``job`` starts ``work`` seconds of work (``work`` < 0: it ends;
    ``more``: the work is added to what it has left). Everyone's progress so far is booked
    at the old speed; every busy job's end is then rescheduled at the new one (a new
    generation: its earlier end event is stale)."""
    done = (t - host[0]) * _host_speed(jobs, host[2])
    for k in range(jobs.shape[1]):
        if jobs[J_ACTIVE, k]:
            jobs[J_LEFT, k] = max(0.0, jobs[J_LEFT, k] - done)
    host[0] = t
    if more:
        jobs[J_LEFT, job] = jobs[J_ACTIVE, job] * jobs[J_LEFT, job] + work
        jobs[J_ACTIVE, job] = 1.0
    else:
        jobs[J_ACTIVE, job] = 1.0 if work >= 0 else 0.0
        jobs[J_LEFT, job] = max(work, 0.0)
    speed = _host_speed(jobs, host[2])
    for k in range(jobs.shape[1]):
        if jobs[J_ACTIVE, k]:
            gen = (int(jobs[J_GEN, k]) + 1) & 0xFFFFFF
            jobs[J_GEN, k] = gen
            end = t + jobs[J_LEFT, k] / speed
            if k == 0:
                _push(ev_t, ev_v, ev_n, end, ENCODE_DONE, int(host[1]), gen)
            else:
                _push(ev_t, ev_v, ev_n, end, HOST_STEP_END, k - 1, gen)


@numba.njit(cache=True, error_model="numpy")
def _serve(t, work, one_host, jobs, host, ev_t, ev_v, ev_n):
    """A hop's ``work`` seconds for the serving job, the last one (on one host only)."""
    if one_host and work > 0:
        _host_change(t, jobs.shape[1] - 1, work, True, jobs, host, ev_t, ev_v, ev_n)


@numba.njit(cache=True, error_model="numpy")
def _start_step(t, p, replica, duration, one_host, jobs, host, ev_t, ev_v, ev_n):
    if one_host:
        _host_change(t, 1 + p, duration, False, jobs, host, ev_t, ev_v, ev_n)
    else:
        _push(ev_t, ev_v, ev_n, t + duration, STEP_END, p, replica)


@numba.njit(cache=True, error_model="numpy")
def run(
    seed,
    rate,
    duration_s,
    warmup_s,
    image_share,
    images_per_request,
    res_probs,
    res_mpix,
    res_tokens,
    prompt_tokens,
    output_tokens,
    geometric_output,
    image_pool,
    encode_servers,
    encode_base_s,
    encode_image_s,
    encode_mpix_s,
    encode_hit_image_s,
    encode_hit_mpix_s,
    encode_exponential,
    encode_enter_delay_s,
    cache_entries,
    pools,
    token_delay_s,
    max_inflight,
    one_host,
    host_cores,
    host_widths,
    local_prefill_tokens,
):
    """Simulate the arrivals of ``duration_s`` (those before ``warmup_s`` are not measured)
    and run until every request is answered. Returns the histograms (rows: TTFT, TPOT,
    latency, encode queue wait) with their exact sums, the counters, the encode pool's busy
    seconds, and per engine pool (summed over its replicas) the seconds of step time beyond
    the steps' fixed cost and the request-seconds present; and the time of the last event."""
    np.random.seed(seed)
    n_pools = pools.shape[0]
    max_rep = 1
    max_seqs = 1
    for p in range(n_pools):
        max_rep = max(max_rep, int(pools[p, P_REPLICAS]))
        max_seqs = max(max_seqs, int(pools[p, P_MAX_SEQS]))

    # Request slots from a free list: memory follows the requests in flight.
    r_arrival = np.zeros(max_inflight)
    r_first = np.zeros(max_inflight)  # first token at the client
    r_service = np.zeros(max_inflight)  # encode service time
    r_joined = np.zeros(max_inflight)  # when it joined the encode queue
    r_images = np.zeros(max_inflight, np.int64)
    r_prompt = np.zeros(max_inflight, np.int64)
    r_left = np.zeros(max_inflight, np.int64)  # prompt tokens not yet prefilled
    r_out = np.zeros(max_inflight, np.int64)
    r_next = np.full(max_inflight, -1, np.int64)  # the replica's waiting queue, linked
    r_started = np.zeros(max_inflight, np.bool_)  # prefill begun (its extra work paid)
    r_local = np.zeros(max_inflight, np.bool_)  # prefilled by decode, prefill skipped
    free = np.arange(max_inflight - 1, -1, -1).astype(np.int64)
    n_free = max_inflight
    inflight = 0

    # Encode pool: a FIFO ring of waiting requests and a count of idle servers.
    enc_queue = np.zeros(max_inflight, np.int64)
    enc_head = 0
    enc_len = 0
    enc_idle = encode_servers
    enc_busy_s = 0.0
    last_insert = np.full(max(image_pool, 1), -(2**62), np.int64)
    inserted = 0

    # Engine replicas: a linked waiting queue each, a heap of running sequences keyed by
    # the step of their last token, and a heap per pool of replica loads.
    wait_head = np.full((n_pools, max_rep), -1, np.int64)
    wait_tail = np.full((n_pools, max_rep), -1, np.int64)
    run_key = np.zeros((n_pools * max_rep, max_seqs), np.int64)
    run_req = np.zeros((n_pools * max_rep, max_seqs), np.int64)
    run_size = np.zeros(n_pools * max_rep, np.int64)
    steps = np.zeros((n_pools, max_rep), np.int64)
    stepping = np.zeros((n_pools, max_rep), np.bool_)
    ctx_sum = np.zeros((n_pools, max_rep))
    done_count = np.zeros((n_pools, max_rep), np.int64)  # prefills ending with this step
    work_s = np.zeros(n_pools)  # step time beyond the fixed cost of a step
    seq_s = np.zeros(n_pools)  # requests present (running or waiting) x seconds
    present = np.zeros(n_pools, np.int64)
    last = np.zeros(n_pools)
    replicas = np.zeros(n_pools, np.int64)
    load_key = np.zeros((n_pools, max_rep), np.int64)
    load_rep = np.zeros((n_pools, max_rep), np.int64)
    load_pos = np.zeros((n_pools, max_rep), np.int64)
    for p in range(n_pools):
        replicas[p] = int(pools[p, P_REPLICAS])
        for i in range(max_rep):
            load_rep[p, i] = i
            load_pos[p, i] = i

    hist = np.zeros((4, HIST_BINS), np.int64)
    sums = np.zeros(4)  # exact sums beside the histograms, for means
    counters = np.zeros(C_COLUMNS, np.int64)
    cum = np.cumsum(res_probs)

    capacity = max_inflight + n_pools * max_rep + 2 + (64 * (n_pools + 2) if one_host else 0)
    ev_t = np.zeros(capacity)
    ev_v = np.zeros(capacity, np.int64)
    ev_n = np.zeros(1, np.int64)

    # One shared host (``one_host``: one encoder, one replica per pool, all on the same
    # ``host_cores`` cores): job 0 is the encoder's pass, job 1 + p a step of pool p, job
    # 1 + n_pools the serving path's backlog (the hops' work), each keeping
    # ``host_widths`` of the cores busy. When they want more than there is, every busy job
    # slows alike (two jobs wanting every core: half speed each), and completions are
    # rescheduled whenever that changes.
    jobs = np.zeros((J_ROWS, n_pools + 2))
    jobs[J_WIDTH, :] = host_widths
    # [time of the last update, request the encoder is serving, cores]
    host = np.array([0.0, 0.0, float(host_cores)])
    # The next arrival waits beside the heap, not in it: a fifth of all events, each
    # spared a push and a pop.
    next_arrival = np.random.exponential(1.0 / rate)
    t = 0.0
    while ev_n[0] > 0 or next_arrival < duration_s:
        if next_arrival < duration_s and (ev_n[0] == 0 or next_arrival <= ev_t[0]):
            t, kind, a, b = next_arrival, ARRIVE, 0, 0
            next_arrival = t + np.random.exponential(1.0 / rate)
        else:
            t, kind, a, b = _pop(ev_t, ev_v, ev_n)
        counters[C_EVENTS] += 1
        if kind == ARRIVE:
            if n_free == 0:
                counters[C_OVERFLOW] = 1
                break
            n_free -= 1
            r = free[n_free]
            inflight += 1
            counters[C_MAX_INFLIGHT] = max(counters[C_MAX_INFLIGHT], inflight)
            counters[C_ARRIVED] += 1
            measured = t >= warmup_s
            r_arrival[r] = t
            r_started[r] = False
            r_next[r] = -1
            n_img = images_per_request if np.random.random() < image_share else 0
            r_images[r] = n_img
            if geometric_output:
                r_out[r] = np.random.geometric(1.0 / output_tokens)
            else:
                r_out[r] = output_tokens
            tokens = prompt_tokens
            work = 0.0
            for _ in range(n_img):
                k = min(np.searchsorted(cum, np.random.random() * cum[-1]), len(cum) - 1)
                tokens += res_tokens[k]
                hit = False
                if image_pool > 0:
                    image = np.random.randint(0, image_pool)
                    hit = inserted - last_insert[image] <= cache_entries
                    if not hit:
                        last_insert[image] = inserted
                        inserted += 1
                if measured:
                    counters[C_IMAGES] += 1
                    if hit:
                        counters[C_HITS] += 1
                if hit:
                    work += encode_hit_image_s + encode_hit_mpix_s * res_mpix[k]
                else:
                    work += encode_image_s + encode_mpix_s * res_mpix[k]
            r_prompt[r] = tokens
            r_left[r] = tokens
            # pools 0 and 1 are prefill and decode: ``Fleet`` allows the limit on E/P/D only
            r_local[r] = 0 < tokens <= local_prefill_tokens
            if r_local[r] and measured:
                counters[C_LOCAL] += 1
            if n_img > 0 and encode_servers > 0:
                mean = encode_base_s + work
                r_service[r] = np.random.exponential(mean) if encode_exponential else mean
                delay = encode_enter_delay_s
                _push(ev_t, ev_v, ev_n, t + delay, ENCODE_JOIN, r, b)
            else:
                delay = pools[0, P_ENTER_DELAY]
                _push(ev_t, ev_v, ev_n, t + delay, ENTER_POOL, r, 1 if r_local[r] else 0)
            _serve(t, delay, one_host, jobs, host, ev_t, ev_v, ev_n)
        elif kind == ENCODE_JOIN:
            if enc_idle > 0:
                enc_idle -= 1
                enc_busy_s += r_service[a]
                if r_arrival[a] >= warmup_s:
                    hist[3, _bin(0.0)] += 1
                if one_host:
                    host[1] = a
                    _host_change(t, 0, r_service[a], False, jobs, host, ev_t, ev_v, ev_n)
                else:
                    _push(ev_t, ev_v, ev_n, t + r_service[a], ENCODE_DONE, a, b)
            else:
                r_joined[a] = t
                enc_queue[(enc_head + enc_len) % max_inflight] = a
                enc_len += 1
        elif kind == ENCODE_DONE:
            if one_host:
                if b != int(jobs[J_GEN, 0]):
                    continue  # rescheduled since
                _host_change(t, 0, -1.0, False, jobs, host, ev_t, ev_v, ev_n)
            if enc_len > 0:  # the first waiting request takes the server
                q = enc_queue[enc_head]
                enc_head = (enc_head + 1) % max_inflight
                enc_len -= 1
                enc_busy_s += r_service[q]
                if r_arrival[q] >= warmup_s:
                    hist[3, _bin(t - r_joined[q])] += 1
                    sums[3] += t - r_joined[q]
                if one_host:
                    host[1] = q
                    _host_change(t, 0, r_service[q], False, jobs, host, ev_t, ev_v, ev_n)
                else:
                    _push(ev_t, ev_v, ev_n, t + r_service[q], ENCODE_DONE, q, 0)
            else:
                enc_idle += 1
            p = 1 if r_local[a] else 0
            delay = pools[0, P_ENTER_DELAY] + pools[p, P_PULL_PER_IMAGE] * r_images[a]
            _push(ev_t, ev_v, ev_n, t + delay, ENTER_POOL, a, p)
            _serve(t, delay, one_host, jobs, host, ev_t, ev_v, ev_n)
        elif kind == ENTER_POOL:
            r = a
            p = b
            replica = load_rep[p, 0]  # the least loaded
            if int(pools[p, P_ROLE]) == ROLE_DECODE and not r_local[r]:
                r_left[r] = 0
            r_next[r] = -1
            if wait_tail[p, replica] < 0:
                wait_head[p, replica] = r
            else:
                r_next[wait_tail[p, replica]] = r
            wait_tail[p, replica] = r
            _add_load(
                load_key, load_rep, load_pos, p, replicas[p], replica, +1, t, seq_s, present, last
            )
            if not stepping[p, replica]:
                duration = _plan_step(
                    t,
                    p,
                    replica,
                    pools,
                    r_left,
                    r_images,
                    r_started,
                    r_next,
                    wait_head,
                    run_size,
                    done_count,
                    ctx_sum,
                    stepping,
                    work_s,
                )
                if duration >= 0:
                    _start_step(
                        t,
                        p,
                        replica,
                        duration,
                        one_host,
                        jobs,
                        host,
                        ev_t,
                        ev_v,
                        ev_n,
                    )
        else:  # STEP_END, HOST_STEP_END
            p = a
            replica = b
            if kind == HOST_STEP_END:
                if b != int(jobs[J_GEN, 1 + p]):
                    continue  # rescheduled since
                _host_change(t, 1 + p, -1.0, False, jobs, host, ev_t, ev_v, ev_n)
                if p == n_pools:
                    continue  # the serving job caught up
                replica = 0
            role = int(pools[p, P_ROLE])
            slot = p * max_rep + replica
            steps[p, replica] += 1
            step = steps[p, replica]
            for _ in range(done_count[p, replica]):  # their prefill ended with this step
                r = wait_head[p, replica]
                wait_head[p, replica] = r_next[r]
                if r_next[r] < 0:
                    wait_tail[p, replica] = -1
                if role != ROLE_PREFILL:  # the first token (a decode engine makes its own)
                    r_first[r] = t + token_delay_s
                    if r_arrival[r] >= warmup_s:
                        hist[0, _bin(r_first[r] - r_arrival[r])] += 1
                        sums[0] += r_first[r] - r_arrival[r]
                if role == ROLE_PREFILL:  # on to the decode pool, after the KV transfer
                    _add_load(
                        load_key,
                        load_rep,
                        load_pos,
                        p,
                        replicas[p],
                        replica,
                        -1,
                        t,
                        seq_s,
                        present,
                        last,
                    )
                    delay = pools[p + 1, P_ENTER_DELAY]
                    _push(ev_t, ev_v, ev_n, t + delay, ENTER_POOL, r, p + 1)
                    _serve(t, delay, one_host, jobs, host, ev_t, ev_v, ev_n)
                elif r_out[r] <= 1:
                    _add_load(
                        load_key,
                        load_rep,
                        load_pos,
                        p,
                        replicas[p],
                        replica,
                        -1,
                        t,
                        seq_s,
                        present,
                        last,
                    )
                    _finish(
                        r,
                        t + token_delay_s,
                        r_arrival,
                        r_first,
                        r_out,
                        warmup_s,
                        hist,
                        sums,
                        counters,
                    )
                    _serve(t, token_delay_s, one_host, jobs, host, ev_t, ev_v, ev_n)
                    inflight -= 1
                    free[n_free] = r
                    n_free += 1
                else:
                    _run_push(run_key, run_req, run_size, slot, step + r_out[r] - 1, r)
                    ctx_sum[p, replica] += r_prompt[r] + 0.5 * r_out[r]
            done_count[p, replica] = 0
            while run_size[slot] > 0 and run_key[slot, 0] <= step:  # their last token
                r = _run_pop(run_key, run_req, run_size, slot)
                ctx_sum[p, replica] -= r_prompt[r] + 0.5 * r_out[r]
                _add_load(
                    load_key,
                    load_rep,
                    load_pos,
                    p,
                    replicas[p],
                    replica,
                    -1,
                    t,
                    seq_s,
                    present,
                    last,
                )
                _finish(
                    r, t + token_delay_s, r_arrival, r_first, r_out, warmup_s, hist, sums, counters
                )
                _serve(t, token_delay_s, one_host, jobs, host, ev_t, ev_v, ev_n)
                inflight -= 1
                free[n_free] = r
                n_free += 1
            stepping[p, replica] = False
            duration = _plan_step(
                t,
                p,
                replica,
                pools,
                r_left,
                r_images,
                r_started,
                r_next,
                wait_head,
                run_size,
                done_count,
                ctx_sum,
                stepping,
                work_s,
            )
            if duration >= 0:
                _start_step(
                    t,
                    p,
                    replica,
                    duration,
                    one_host,
                    jobs,
                    host,
                    ev_t,
                    ev_v,
                    ev_n,
                )
    for p in range(n_pools):
        seq_s[p] += present[p] * (t - last[p])
    return hist, sums, counters, enc_busy_s, work_s, seq_s, t


@numba.njit(cache=True, error_model="numpy")
def _finish(r, t, r_arrival, r_first, r_out, warmup_s, hist, sums, counters):
    counters[C_COMPLETED] += 1
    if r_arrival[r] < warmup_s:
        return
    counters[C_MEASURED] += 1
    hist[2, _bin(t - r_arrival[r])] += 1
    sums[2] += t - r_arrival[r]
    if r_out[r] > 1:
        tpot = (t - r_first[r]) / (r_out[r] - 1)
        hist[1, _bin(tpot)] += 1
        sums[1] += tpot


@numba.njit(cache=True, error_model="numpy")
def _plan_step(
    t,
    p,
    replica,
    pools,
    r_left,
    r_images,
    r_started,
    r_next,
    wait_head,
    run_size,
    done_count,
    ctx_sum,
    stepping,
    work_s,
):
    """Plan the replica's next step if it has work: decode every running sequence, then
    prefill waiting prompts in order within the token budget and the sequence limit.
    Returns its duration (-1: nothing to do); the caller schedules its end. (Its two
    callers spell out the arrays: passing them as tuples cost ~15% of the run time.)"""
    max_rep = wait_head.shape[1]
    slot = p * max_rep + replica
    running = run_size[slot]
    budget = int(pools[p, P_BUDGET]) - running
    seats = int(pools[p, P_MAX_SEQS]) - running
    prefill = 0
    extra = 0.0
    done = 0
    r = wait_head[p, replica]
    while r >= 0 and seats > 0 and budget > 0:
        if not r_started[r]:
            r_started[r] = True
            extra += pools[p, P_EXTRA_PER_IMAGE] * r_images[r] + pools[p, P_PER_REQUEST]
        chunk = min(r_left[r], budget)
        r_left[r] -= chunk
        prefill += chunk
        budget -= chunk
        if r_left[r] > 0:
            break  # chunked: the rest in the next step
        done += 1
        seats -= 1
        r = r_next[r]
    if running == 0 and done == 0 and prefill == 0:
        return -1.0
    if prefill > 0:
        extra += pools[p, P_PREFILL_STEP]
    duration = (
        pools[p, P_BASE]
        + pools[p, P_PER_TOKEN] * prefill
        + pools[p, P_PER_SEQ] * running
        + pools[p, P_PER_KCTX] * ctx_sum[p, replica] / 1000.0
        + extra
    )
    done_count[p, replica] = done
    stepping[p, replica] = True
    work_s[p] += duration - pools[p, P_BASE]
    return duration
