"""The pause state machine (sessions/pause_machine.py) on its own: a real KV
manager and radix cache, transfers that only keep books, a clock the test
moves. The engine's SessionManager and the simulator's PauseController run
this same machine (their tests: test_sessions, test_copy_engine,
test_pressure, test_sim_pauses)."""
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.cost_rates import CostRates
from trajserve.kv.scope import CacheScope
from trajserve.sessions.keep_policy import Decision, KeepPolicy
from trajserve.sessions.manager import SessionManager
from trajserve.sessions.pause_machine import PauseCounts, PauseMachine, Residency
from trajserve.sim import pauses as sim_pauses

B = 4


class Record:
    """A PausedRecord (the fields the machine reads and writes)."""

    def __init__(self, history):
        self.history, self.keys, self.scope = history, None, CacheScope()
        self.paused_at = self.decision = self.tier = self.residency = self.pin = None
        self.lease_deadline = self.prefetch_at = None
        self.expected_wait_s, self.forced, self.prefetched, self.priority = 0.0, False, False, 0


class Books:
    """Transfers that copy nothing: room per tier in blocks, saves that land when told."""

    def __init__(self, kv, host_blocks, disk_blocks):
        self.kv, self.room = kv, {Decision.HOST: host_blocks, Decision.DISK: disk_blocks}
        self.saving, self.saved, self.landed_cb = {}, {}, {}

    def free_bytes(self, tier):
        return self.room[tier] * 100

    def reserve(self, tier, n):
        if n > self.room[tier]:
            return False
        self.room[tier] -= n
        return True

    def save(self, p, tier, hit, sync):
        self.saving[id(p)] = (p, tier, len(hit.block_ids))
        if sync:
            self.land(p)

    def land(self, p):
        p, tier, n = self.saving.pop(id(p))
        self.saved[id(p)] = (tier, n)
        p.residency = Residency.OFFLOADED
        self.kv.evict_prefix(p.history, p.scope)

    def load(self, p, now, landed):
        tier, n = self.saved.pop(id(p))
        self.room[tier] += n
        got = self.kv.begin_import(p.history, p.scope, n)
        hit, new = got
        self.kv.finish_import(p.history, p.scope, hit, new, len(new))
        if landed is not None:
            self.landed_cb[id(p)] = (p, landed)  # lands when the test says so
        return True

    def reload_s(self, p, tier):
        return 1.0

    def busy(self, p):
        return id(p) in self.saving or id(p) in self.landed_cb

    def before_resume(self, p):
        pass

    def land_saves(self, need):
        return 0

    def land_all(self):
        return False


def machine(host_blocks=100, disk_blocks=100, ceiling=0.9, host_rate=1e9):
    kv = KVCacheManager(64, B, 0.0, enable_prefix_caching=True)
    rates = CostRates(prefill_tokens_per_s=10.0, host_bytes_per_s=host_rate, disk_bytes_per_s=host_rate / 10)
    books = Books(kv, host_blocks, disk_blocks)
    clock = [0.0]
    m = PauseMachine(kv, KeepPolicy(rates, admission_ceiling=ceiling), books, PauseCounts(), block_bytes=100,
                     ceiling_blocks=lambda: int(ceiling * kv.num_blocks), clock=lambda: clock[0])
    return m, kv, books, clock


def cached(kv, tokens):
    """tokens' full blocks computed and cached, held by nobody (as after a turn)."""
    kv.allocate_slots("r", len(tokens))
    kv.cache_computed("r", tokens, len(tokens), CacheScope())
    kv.release("r", tokens, len(tokens), CacheScope())


def test_a_lease_runs_out_then_the_state_saves_offloads_prefetches_and_resumes():
    m, kv, books, clock = machine()
    hist = list(range(1, 41))  # 10 blocks
    cached(kv, hist)
    p = Record(hist)
    d = m.pause("a", p, 10.0, True, "keep", now=0.0)
    assert d.decision is Decision.KEEP and p.residency is Residency.KEPT and p.pin is not None
    m.set_lease(p, 1.0)
    m.tick(0.5)
    assert p.residency is Residency.KEPT  # not yet
    clock[0] = 1.0
    m.tick(1.0)
    assert m.stats.lease_demotions == 1 and p.tier in (Decision.HOST, Decision.DISK)
    assert p.residency is Residency.SAVING and p.pin is None
    books.land(p)
    assert p.residency is Residency.OFFLOADED and kv.cached_prefix(hist, CacheScope()).num_tokens == 0
    # prefetch_fraction 0.8 x 10 s less the 1 s reload: due at 7 s
    assert p.prefetch_at == 7.0 and m.next_timer() == 7.0
    clock[0] = 7.0
    m.tick(7.0)
    assert p.residency is Residency.LOADING
    _, landed = books.landed_cb.pop(id(p))
    landed(p, True)
    assert p.residency is Residency.KEPT and p.prefetched and p.pin is not None and m.stats.prefetches == 1
    m.resume("a", 9.0)
    assert m.stats.prefetch_hits == 1 and m.stats.resume_stalls == 0 and len(kv.holds) == 1
    assert p.residency is None and p.tier is None and "a" not in m.paused
    assert m.stats.recomputed_tokens == 0  # all 10 blocks there (the last token is always recomputed)


def test_a_full_tier_falls_through_to_the_next_and_then_to_drop():
    m, kv, books, _ = machine(host_blocks=5, disk_blocks=5)
    hist = list(range(1, 41))
    cached(kv, hist)
    p = Record(hist)
    m.pause("a", p, 5.0, True, "host", now=0.0)
    assert p.tier is Decision.DROP and p.residency is Residency.DROPPED
    assert kv.cached_prefix(hist, CacheScope()).num_tokens == 0  # a drop frees the path
    assert m.stats.decisions == {"host": 1} and m.stats.placed == {"drop": 1}
    m2, kv2, books2, _ = machine(host_blocks=5, disk_blocks=50)
    cached(kv2, hist)
    q = Record(hist)
    m2.pause("b", q, 5.0, True, "host", now=0.0)
    assert q.tier is Decision.DISK and books2.room[Decision.DISK] == 40 and books2.room[Decision.HOST] == 5


def test_pressure_moves_kept_state_expected_back_last_first_and_spares_forced_keeps():
    m, kv, books, _ = machine(host_rate=1e3)  # a slow link: the policy keeps short waits
    soon, late, forced = Record(list(range(1, 17))), Record(list(range(101, 117))), Record(list(range(201, 217)))
    for r in (soon, late, forced):
        cached(kv, r.history)
    assert m.pause("soon", soon, 1.0, True, None, now=0.0).decision is Decision.KEEP
    assert m.pause("late", late, 2.0, True, None, now=0.0).decision is Decision.KEEP
    m.pause("forced", forced, 100.0, True, "keep", now=0.0)
    assert m.reclaim(1) >= 1 and m.stats.pressure_demotions == 1
    # pressure needs the frames now: the save lands before reclaim returns
    assert late.pin is None and late.residency is Residency.OFFLOADED and m.stats.demoted_to == {"host": 1}
    assert soon.pin is not None and forced.pin is not None
    m.reclaim(100)  # all it can: the forced keep stays
    assert soon.pin is None and forced.pin is not None and m.stats.pressure_demotions == 2


def test_pressure_moves_the_least_urgent_sessions_state_first():
    """Of two kept states, the one expected back first but of a less urgent
    session (priority 4 against -1) leaves the device first; relieving a stall
    drops the least urgent too, whatever its age."""
    m, kv, _, clock = machine(host_rate=1e3)
    urgent, bulk = Record(list(range(1, 17))), Record(list(range(101, 117)))
    urgent.priority, bulk.priority = -1, 4
    for r in (urgent, bulk):
        cached(kv, r.history)
    assert m.pause("urgent", urgent, 2.0, True, None, now=0.0).decision is Decision.KEEP
    assert m.pause("bulk", bulk, 1.0, True, None, now=0.0).decision is Decision.KEEP
    assert m.reclaim(1) >= 1
    assert bulk.pin is None and urgent.pin is not None
    m2, kv2, _, _ = machine(host_rate=1e3)
    old, new = Record(list(range(1, 17))), Record(list(range(101, 117)))
    old.priority, new.priority = -1, 4
    for r in (old, new):
        cached(kv2, r.history)
    m2.pause("old", old, 100.0, True, "keep", now=0.0)
    m2.pause("new", new, 100.0, True, "keep", now=1.0)
    assert m2.relieve_stall() and new.pin is None and old.pin is not None


def test_a_forgotten_records_timers_do_nothing():
    m, kv, books, clock = machine()
    hist = list(range(1, 21))
    cached(kv, hist)
    p = Record(hist)
    m.pause("a", p, 10.0, True, "keep", now=0.0)
    m.set_lease(p, 1.0)
    m.forget("a")
    assert kv.num_active_blocks == 0  # its pin went
    clock[0] = 2.0
    m.tick(2.0)
    assert m.stats.lease_demotions == 0 and not books.saving and p.tier is None


def test_the_engine_and_the_simulator_run_this_machine():
    """One state machine: neither side defines a transition of its own."""
    transitions = {"_place", "_save", "_demote", "_prefetch", "_reclaim", "_relieve_stall"}
    assert not transitions & set(vars(SessionManager))
    assert not transitions & set(vars(sim_pauses.PauseController))
    assert not transitions & set(vars(sim_pauses.CostModelLink))
    assert sim_pauses.PauseMachine is PauseMachine


def test_a_session_prices_the_pool_without_the_kept_state_of_less_urgent_ones():
    """Kept state of a batch session (priority 4) fills the pool past the
    ceiling: a plain session pausing beside it is moved off the device (the
    pool is past the ceiling), an urgent one (priority -1) is kept, as the
    batch state would go first if the pool needed its frames."""
    m, kv, _, _ = machine(ceiling=0.5, host_rate=1e3)  # a slow link: the policy keeps short waits
    bulk, plain, urgent = Record(list(range(1, 161))), Record(list(range(201, 217))), Record(list(range(301, 317)))
    bulk.priority, plain.priority, urgent.priority = 4, 4, -1
    for r in (bulk, plain, urgent):
        cached(kv, r.history)
    assert m.pause("bulk", bulk, 1.0, True, None, now=0.0).decision is Decision.KEEP  # 40 of 64 blocks
    assert kv.active_usage() > 0.5
    d = m.pause("plain", plain, 1.0, True, None, now=0.0)
    assert d.decision is not Decision.KEEP and "ceiling" in d.reason
    assert m.pause("urgent", urgent, 1.0, True, None, now=0.0).decision is Decision.KEEP
