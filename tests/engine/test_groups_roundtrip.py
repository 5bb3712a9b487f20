"""The groups of a ``Moments(groups=k)`` survive every round trip: ``save`` /
``load``, ``state_dict`` / ``load_state_dict``, ``copy`` / ``deepcopy`` /
``pickle``, a merge of two grouped states and ``richness merge``. After the
trip the next updates go to the groups they would have gone to, and the
jackknife of ``compute(uncertainty=True)`` is the one without the trip, bit
for bit, and the delete-one-group jackknife of a float64 reference computed
from the raw rows of each group. A version-1 file (written before groups were
saved) still loads, as the state of all its samples.

Which rows a group holds is derived here from the documented rule (each
accepted update goes whole to one group: in turn, or drawn by
``numpy.random.default_rng(group_seed).integers(k)``, one draw per accepted
update), not read from the code under test."""

import copy
import hashlib
import json
import pickle
import warnings

import numpy as np
import pytest

import richness
from richness import RichnessWarning
from reference import dlr_naive, states_equal

K, P, C = 4, 6, 3


def data(n=540, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, P)) @ rng.normal(size=(P, P)) + 1.5
    F = X @ rng.normal(size=(P, C)) + np.tanh(X[:, :C])
    y = rng.integers(0, 5, n)
    return X, F, y


class Feed:
    """Batches of 30 rows in order, and the group each accepted batch went to
    by the documented rule."""

    def __init__(self, k=K, seed=None):
        self.k, self.rng = k, (None if seed is None else np.random.default_rng(seed))
        self.turn, self.rows = 0, [[] for _ in range(k)]

    def group(self):
        if self.rng is None:
            g, self.turn = self.turn, (self.turn + 1) % self.k
            return g
        return int(self.rng.integers(self.k))

    def add(self, ms, X, F, y, lo, hi, reject_first=False):
        """Batches of rows lo..hi into every Moments of ``ms``; a batch with a
        NaN is refused first when asked (it moves no group)."""
        for start in range(lo, hi, 30):
            sl = slice(start, start + 30)
            if reject_first and start == lo:
                bad = X[sl].copy()
                bad[2, 1] = np.nan
                for m in ms:
                    with pytest.raises(ValueError, match="non-finite"):
                        m.update(bad, F[sl], labels=y[sl])
            for m in ms:
                m.update(X[sl], F[sl], labels=y[sl])
            self.rows[self.group()].extend(range(start, min(start + 30, hi)))


def reference_jackknife(X, F, groups, rtol):
    """DLR, its jackknife standard error and bias-corrected value from the
    raw float64 rows, leaving out each group in turn."""
    k = len(groups)
    everything = np.concatenate(groups)
    theta = np.array([dlr_naive(X[np.setdiff1d(everything, g)], F[np.setdiff1d(everything, g)], rtol)[0]
                      for g in groups])
    full = dlr_naive(X[everything], F[everything], rtol)[0]
    se = np.sqrt((k - 1) / k * np.sum((theta - theta.mean()) ** 2))
    return full, se, k * full - (k - 1) * theta.mean()


def jackknife(m):
    r = m.compute(uncertainty=True)
    return (r.dlr, r.dlr_stderr, r.dlr_jackknife, r.dlr_interval, tuple(sorted(r.measures_stderr.items())))


def assert_matches_reference(m, X, F, feed):
    r = m.compute(uncertainty=True)
    groups = [np.array(rows) for rows in feed.rows]
    assert [len(g) for g in groups] == [s["n"] for s in m.state_dict()["groups"]["states"]]
    dlr, se, corrected = reference_jackknife(X, F, groups, r.rtol)
    assert abs(r.dlr - dlr) < 1e-10
    assert abs(r.dlr_stderr - se) < 1e-9 and se > 0
    assert abs(r.dlr_jackknife - corrected) < 1e-9


def _save_load(m, tmp_path):
    m.save(tmp_path / "grouped.npz")
    return richness.Moments.load(tmp_path / "grouped.npz")


def _state_dict(m, tmp_path):
    out = richness.Moments(groups=K)
    out.load_state_dict(m.state_dict())
    return out


ROUTES = {"save_load": _save_load, "state_dict": _state_dict,
          "copy": lambda m, _: copy.copy(m), "deepcopy": lambda m, _: copy.deepcopy(m),
          "pickle": lambda m, _: pickle.loads(pickle.dumps(m))}


@pytest.mark.parametrize("seed", [None, 11])
@pytest.mark.parametrize("route", ROUTES)
def test_groups_and_the_assignment_survive_the_round_trip(tmp_path, route, seed):
    X, F, y = data()
    feed = Feed(seed=seed)
    orig = richness.Moments(groups=K, group_seed=seed)
    # 7 batches: the groups are uneven, and (at random) a refused batch has drawn the next group
    feed.add([orig], X, F, y, 0, 210, reject_first=True)
    before = orig.state_dict()
    dup = ROUTES[route](orig, tmp_path)
    assert dup._groups == K and states_equal(dup.state_dict(), before)
    assert jackknife(dup) == jackknife(orig)
    assert_matches_reference(dup, X, F, feed)
    # the next updates go to the same groups as without the trip (a refused one first again)
    feed.add([orig, dup], X, F, y, 210, 480, reject_first=True)
    assert states_equal(dup.state_dict(), orig.state_dict())
    assert jackknife(dup) == jackknife(orig)
    assert_matches_reference(dup, X, F, feed)


@pytest.mark.parametrize("seed", [None, 5])
def test_a_grouped_moments_before_its_first_batch_round_trips(tmp_path, seed):
    X, F, y = data()
    feed = Feed(seed=seed)
    fresh = richness.Moments(groups=K, group_seed=seed)
    fresh.save(tmp_path / "empty.npz")
    loaded = richness.Moments.load(tmp_path / "empty.npz")
    via_dict = richness.Moments(groups=K)
    via_dict.load_state_dict(fresh.state_dict())
    feed.add([fresh, loaded, via_dict], X, F, y, 0, 300)
    for m in (loaded, via_dict):
        assert m._groups == K and states_equal(m.state_dict(), fresh.state_dict())
    assert_matches_reference(loaded, X, F, feed)


def test_a_saved_file_of_groups_records_version_2(tmp_path):
    X, F, y = data()
    m = richness.Moments(groups=3, group_seed=4)
    Feed(3, 4).add([m], X, F, y, 0, 120)
    m.save(tmp_path / "g.npz")
    with np.load(tmp_path / "g.npz", allow_pickle=False) as z:
        meta = json.loads(z["meta"].tobytes().decode())
        names = set(z.files)
    assert meta["version"] == 2 and meta["groups"]["seed"] == 4 and len(meta["groups"]["states"]) == 3
    assert {f"group{i}.M" for i in range(3)} <= names


# -- a file in the version-1 layout ------------------------------------------------

def _v1_digest(scalars, arrays):
    """The checksum of a version-1 file: SHA-256 over the scalars' sorted JSON,
    then each array's name, shape and bytes in the order written."""
    h = hashlib.sha256()
    h.update(json.dumps(scalars, sort_keys=True).encode())
    for key, a in arrays.items():
        a = np.ascontiguousarray(a)
        h.update(key.encode())
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def write_v1(path, X, F, y):
    """A file as version 1 wrote it (what ``save`` wrote of a Moments(groups=k) then: the
    state of all samples, nothing of its groups), from float64 numpy on the raw rows."""
    Xc, Fc = X - X.mean(0), F - F.mean(0)
    k = int(y.max()) + 1
    scalars = {"n": len(X), "p": P, "c": C, "t": -1, "k": k, "num_classes": -1, "precision": "fp64"}
    arrays = {"mean": X.mean(0), "M": Xc.T @ Xc, "out_mean": F.mean(0), "B": Xc.T @ Fc, "A": Fc.T @ Fc,
              "tgt_mean": np.zeros(0), "Bt": np.zeros((P, 0)), "At": np.zeros((0, 0)),
              "class_sums": np.stack([X[y == j].sum(0) for j in range(k)]),
              "class_counts": np.bincount(y, minlength=k).astype(np.int64)}
    meta = {"format": "richness.moments", "version": 1, **scalars, "sha256": _v1_digest(scalars, arrays)}
    np.savez(path, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    return arrays


def test_a_version_1_file_loads_as_the_state_of_all_its_samples(tmp_path):
    X, F, y = data(240)
    want = write_v1(tmp_path / "v1.npz", X, F, y)
    m = richness.Moments.load(tmp_path / "v1.npz")
    assert m._groups is None and m.n == 240
    st = m.state_dict()
    assert "groups" not in st
    for key, a in want.items():
        np.testing.assert_allclose(st[key], a, rtol=1e-12, atol=1e-9, err_msg=key)
    assert abs(m.compute().dlr - dlr_naive(X, F)[0]) < 1e-12
    with pytest.raises(ValueError, match="needs the samples kept in groups"):
        m.compute(uncertainty=True)
    # into a Moments(groups=k) it is one block, in the first group; later updates fill the others
    g = richness.Moments(groups=3)
    g.load_state_dict(st)
    assert [s["n"] for s in g.state_dict()["groups"]["states"]] == [240, 0, 0]
    g.update(X[:30], F[:30], labels=y[:30])
    g.update(X[30:60], F[30:60], labels=y[30:60])
    assert [s["n"] for s in g.state_dict()["groups"]["states"]] == [240, 30, 30]


# -- states of other group counts ------------------------------------------------------

def _filled(groups, seed=None, lo=0, hi=240):
    X, F, y = data()
    m = richness.Moments(groups=groups, group_seed=seed)
    feed = Feed(groups or 1, seed)
    feed.add([m], X, F, y, lo, hi)
    return m, feed


@pytest.mark.parametrize("into", [None, 3])
def test_a_state_of_other_groups_is_refused_naming_both_counts(into):
    src, _ = _filled(K)
    target, _ = _filled(into)
    before = target.state_dict()
    mine = "keeps none" if into is None else "keeps 3"
    with pytest.raises(ValueError, match=rf"the state holds {K} groups, this Moments {mine}"):
        target.load_state_dict(src.state_dict())
    assert states_equal(target.state_dict(), before)


def test_merging_other_group_counts_is_refused_naming_both_counts():
    a, _ = _filled(K)
    b, _ = _filled(3)
    before = a.state_dict()
    with pytest.raises(ValueError, match=rf"this Moments keeps {K} groups, the other 3"):
        a.merge(b)
    with pytest.raises(ValueError, match=rf"this Moments keeps 3 groups, the other {K}"):
        b.merge(richness.Moments(groups=K))  # refused even when the other is empty
    assert states_equal(a.state_dict(), before)


def test_a_whole_edited_apart_from_its_groups_is_refused():
    src, _ = _filled(K)
    target, _ = _filled(K, lo=240, hi=480)
    before = target.state_dict()
    st = src.state_dict()
    bad = dict(st, M=st["M"] * (1 + 1e-6))
    with pytest.raises(ValueError, match="not the merge of the state's groups"):
        target.load_state_dict(bad)
    fewer = copy.deepcopy(st)
    fewer["groups"]["states"][1] = richness._state.empty()  # group 1's 60 samples lost
    with pytest.raises(ValueError, match="the groups hold 180 samples between them, the whole state n=240"):
        target.load_state_dict(fewer)
    for entry, message in (({"next": K}, "'next' must be a group index"),
                           ({"rng": {"bit_generator": "MT19937"}}, "'rng' is not the state"),
                           ({"seed": -3}, "'seed' must be None or a non-negative integer")):
        edited = copy.deepcopy(st)
        edited["groups"].update(entry)
        with pytest.raises(ValueError, match=message):
            target.load_state_dict(edited)
    assert states_equal(target.state_dict(), before)


# -- merges -------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [None, 8])
def test_merging_grouped_states_merges_group_by_group(seed):
    X, F, y = data()
    a, fa = _filled(K, seed, 0, 240)
    b, fb = _filled(K, seed, 240, 480)
    a.merge(b)
    assert a.n == 480
    merged = Feed(K)
    merged.rows = [ra + rb for ra, rb in zip(fa.rows, fb.rows)]  # group i of each, together
    assert_matches_reference(a, X, F, merged)
    # the assignment of a's next updates is a's own, as before the merge
    fa.rows = merged.rows
    fa.add([a], X, F, y, 480, 540)
    assert_matches_reference(a, X, F, fa)


def test_a_grouped_state_merged_into_one_without_groups_warns():
    X, F, _ = data()
    g, _ = _filled(K)
    plain = richness.Moments()
    with pytest.warns(RichnessWarning, match=r"groups=4\) into a Moments without groups"):
        plain.merge(g)
    assert abs(plain.compute().dlr - dlr_naive(X[:240], F[:240])[0]) < 1e-10
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain.merge(richness.Moments(groups=K))  # an empty one drops nothing
        g.merge(richness.Moments())  # into one group of g: nothing dropped


def test_richness_merge_keeps_the_groups(tmp_path, capsys):
    from richness.cli import main

    X, F, y = data()
    a, fa = _filled(K, 9, 0, 240)
    b, fb = _filled(K, 9, 240, 480)
    a.save(tmp_path / "a.npz")
    b.save(tmp_path / "b.npz")
    assert main(["merge", str(tmp_path / "out.npz"), str(tmp_path / "a.npz"), str(tmp_path / "b.npz")]) == 0
    out = richness.Moments.load(tmp_path / "out.npz")
    merged = Feed(K)
    merged.rows = [ra + rb for ra, rb in zip(fa.rows, fb.rows)]
    assert out._groups == K
    assert_matches_reference(out, X, F, merged)
    # other group counts: refused by name, nothing written
    c, _ = _filled(3)
    c.save(tmp_path / "c.npz")
    assert main(["merge", str(tmp_path / "bad.npz"), str(tmp_path / "a.npz"), str(tmp_path / "c.npz")]) != 0
    assert "keeps 4 groups, the other 3" in capsys.readouterr().err
    assert not (tmp_path / "bad.npz").exists()
    # a file without groups first: the merge cannot keep the second's groups, and says so
    plain = richness.Moments()
    plain.update(X[:30], F[:30], labels=y[:30])
    plain.save(tmp_path / "plain.npz")
    with pytest.warns(RichnessWarning, match="groups are not kept"):
        assert main(["merge", str(tmp_path / "mixed.npz"), str(tmp_path / "plain.npz"),
                     str(tmp_path / "a.npz")]) == 0


def test_grouped_state_with_fixed_classes_loads_into_a_moments_without_them(tmp_path):
    """Moments.load builds Moments(groups=k) without num_classes: the groups are rebuilt for the file's
    classes (they were built for none, and their merge disagreed with the whole state)."""
    rng = np.random.default_rng(3)
    X = rng.normal(size=(240, 6)) + 2.0
    F = X @ rng.normal(size=(6, 3)) + 0.1 * rng.normal(size=(240, 3))
    y = rng.integers(0, 4, 240)
    m = richness.Moments(num_classes=4, groups=4)
    for i in range(0, 240, 30):
        m.update(X[i:i + 30], outputs=F[i:i + 30], labels=y[i:i + 30])
    m.save(tmp_path / "s.npz")
    back = richness.Moments.load(tmp_path / "s.npz")
    fresh = richness.Moments(groups=4)
    fresh.load_state_dict(m.state_dict())
    want = dlr_naive(X, F)[0]
    for other in (back, fresh):
        assert other.num_classes == 4
        rep = other.compute(uncertainty=True)
        assert abs(rep.dlr - want) < 1e-10 and rep.dlr_stderr is not None
    refused = richness.Moments(groups=3)
    with pytest.raises(ValueError, match="holds 4 groups"):
        refused.load_state_dict(m.state_dict())
    assert refused.num_classes is None and refused.n == 0
