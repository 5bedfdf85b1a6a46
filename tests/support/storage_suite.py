"""The conformance suite of the storage interface: every ``Location`` backend passes it.

A backend's test module subclasses ``LocationTests`` and gives ``new_url()``, a URL of a fresh,
empty place for a checkpoint. The suite checks the contract the rest of layoutckpt relies on:
documents read back as written, nothing is a checkpoint before its commit, a commit makes the
staging area the checkpoint at once, a committed checkpoint is not overwritten by accident,
discard deletes, retire deletes a committed checkpoint, the box writer stores what plain
TensorStore reads back, and the box reader reads exactly the stored elements and names damage.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest

import layoutckpt as lc
from layoutckpt.base._options import DEFAULT_IO
from layoutckpt.engine._read import BoxRead, read_into
from layoutckpt.format._shard import BINDING_BYTES, binding, index_bytes
from layoutckpt.storage._commit import new_token
from layoutckpt.storage._location import PENDING, Location, locate


class LocationTests:
    def new_url(self) -> str:
        raise NotImplementedError

    def location(self) -> Location:
        loc = locate(self.new_url())
        assert isinstance(loc, Location)
        return loc

    def test_a_missing_document_reads_as_none_and_a_written_one_as_written(self):
        loc = self.location()
        assert loc.read("nothing/here.json") is None
        loc.write("a/b.json", b'{"x": 1}')
        loc.write_many([("c.json", b"1"), ("d/e.json", b"22")])
        assert loc.read("a/b.json") == b'{"x": 1}'
        assert (loc.read("c.json"), loc.read("d/e.json")) == (b"1", b"22")
        assert loc.exists()

    def test_nothing_is_a_checkpoint_before_its_commit_and_all_of_it_after(self):
        final = self.location()
        assert not final.exists() and not final.committed()
        final.check_destination(overwrite=False)
        final.prepare()
        staging = final.staging(new_token())
        final.claim(staging, "id-1")
        staging.write("arr/zarr.json", b"{}")
        staging.make_durable()
        assert not final.committed()
        with pytest.raises(lc.CheckpointNotFoundError):
            lc.open(final.url)
        final.commit(staging, b'{"marker": true}', overwrite=False, save_id="id-1")
        assert final.committed()
        assert final.read("arr/zarr.json") == b"{}"
        assert final.read("zarr.json") == b'{"marker": true}'
        assert final.read(PENDING) is None

    def test_a_staging_area_another_process_cleared_or_claimed_is_never_committed(self):
        # What ``layoutckpt gc`` or a second save does to a save under way: the writes that
        # come after make the folder or prefix again, but not the claim of the first save.
        for intruder in ("cleared", "claimed"):
            final = self.location()
            final.prepare()
            staging = final.staging(new_token())
            final.claim(staging, "first")
            staging.write("arr/c/0", b"first's shard")
            staging.discard()
            if intruder == "claimed":
                final.prepare()
                final.claim(final.staging(new_token()), "second")
            staging.write("arr/zarr.json", b"{}")
            with pytest.raises(lc.SaveError, match="no longer holds this save's claim"):
                final.commit(staging, b'{"marker": true}', overwrite=False, save_id="first")
            assert not final.committed()

    def test_a_committed_checkpoint_is_never_replaced_by_accident(self):
        url = self.new_url()
        lc.save(url, {"x": np.arange(3)})
        with pytest.raises(lc.CheckpointExistsError):
            locate(url).check_destination(overwrite=False)
        with pytest.raises(lc.CheckpointExistsError):
            lc.save(url, {"x": np.arange(4)})
        assert lc.load(url)["x"].tolist() == [0, 1, 2]

    def test_a_commit_never_replaces_a_checkpoint_committed_meanwhile(self):
        # Two saves to one path that both passed the check for a committed checkpoint: the
        # second to commit finds the first's marker (a rename onto its directory, or a
        # conditional write of the root document).
        final = self.location()
        for save_id, data in (("first", b'{"m": 1}'), ("second", b'{"m": 2}')):
            staging = final.staging(new_token())
            final.claim(staging, save_id)
            staging.write("a/zarr.json", data)
            staging.make_durable()
            if save_id == "first":
                final.commit(staging, data, overwrite=False, save_id=save_id)
        with pytest.raises(lc.CheckpointExistsError, match="committed"):
            final.commit(staging, data, overwrite=False, save_id="second")
        assert final.read("zarr.json") == b'{"m": 1}'

    def test_discard_deletes_everything_stored_there(self):
        loc = self.location()
        loc.write("a.json", b"1")
        loc.write("b/c.json", b"2")
        loc.discard()
        assert loc.read("a.json") is None and loc.read("b/c.json") is None and not loc.exists()

    def test_the_box_reader_reads_exactly_the_stored_elements(self):
        url = self.new_url()
        full = np.arange(43 * 24, dtype=np.float32).reshape(43, 24)
        lc.save(url, {"w": full}, inner_chunk_bytes=8 * 24 * 4)
        rd = lc.open(url)
        meta = rd.meta.arrays["w"]
        reader = locate(url).box_reader(url, rd.meta.all_chunks_stored, DEFAULT_IO)
        boxes = [((0, 40), (0, 24)), ((3, 17), (5, 9)), ((39, 40), (0, 24)), ((7, 7), (0, 24))]
        got = read_into(reader, [BoxRead("w", meta, box) for box in boxes])
        for box, data in zip(boxes, got):
            assert np.array_equal(data, full[tuple(slice(a, b) for a, b in box)])

    def test_the_box_reader_names_the_damaged_array(self):
        url = self.new_url()
        lc.save(url, {"w": np.arange(64, dtype=np.int64)})
        loc = locate(url)
        rd = lc.open(url)
        meta = rd.meta.arrays["w"]
        key = f"{meta.path}/{meta.chunk_key((0,))}"
        shard = bytearray(loc.read(key))
        shard[3] ^= 0xFF  # inside the first inner chunk
        loc.write(key, bytes(shard))
        reader = loc.box_reader(url, rd.meta.all_chunks_stored, DEFAULT_IO)
        with pytest.raises(lc.IntegrityError, match=r"array 'w' of checkpoint .* is damaged"):
            read_into(reader, [BoxRead("w", meta, ((0, 64),))])

    def test_retire_deletes_a_committed_checkpoint(self):
        url = self.new_url()
        lc.save(url, {"x": np.arange(3)})
        loc = locate(url)
        loc.retire()
        assert not loc.committed() and not loc.exists()
        with pytest.raises(lc.CheckpointNotFoundError):
            lc.open(url)

    def test_the_box_writer_stores_whole_shards_and_parts_of_shards(self):
        """A box that is a whole shard is stored byte for byte as ``save`` stores it, binding
        block included; the same shard as two parts (TensorStore's path on every store) is
        stored so for an unbound array (without the block), and refused for a bound one, whose
        block TensorStore cannot write. The last inner chunk overhangs the array's edge, so its
        padding is compared too."""
        url = self.new_url()
        full = np.arange(43 * 24, dtype=np.float32).reshape(43, 24)
        lc.save(url, {"w": full}, inner_chunk_bytes=8 * 24 * 4)
        final = locate(url)
        meta = lc.open(url).meta.arrays["w"]
        assert meta.bound_to is not None
        key = f"{meta.path}/{meta.chunk_key((0, 0))}"
        saved = final.read(key)
        assert saved is not None
        at = len(saved) - index_bytes(meta.shard_shape, meta.inner_chunk_shape) - BINDING_BYTES
        assert saved[at : at + BINDING_BYTES] == binding(meta.bound_to, meta.path, (0, 0))
        whole, parts = [((0, 43), (0, 24))], [((0, 13), (0, 24)), ((13, 43), (0, 24))]
        unbound = attrs.evolve(meta, bound_to=None)
        for boxes, a, want in ((whole, meta, saved), (parts, unbound, saved[:at] + saved[at + BINDING_BYTES :])):
            staging = final.staging(new_token())
            sources = [_Held(full[tuple(slice(a, b) for a, b in box)]) for box in boxes]
            with staging.box_writer(DEFAULT_IO) as writer:
                for box, source in zip(boxes, sources):
                    writer.write(a, box, source)
                assert writer.join() == full.nbytes
            assert staging.read(key) == want
        staging = final.staging(new_token())
        with staging.box_writer(DEFAULT_IO) as writer, pytest.raises(ValueError, match="binding block"):
            writer.write(meta, parts[0], _Held(full[:13]))
        staging.discard()


class _Held:
    """A box's elements at hand, as a writer's source."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def wait(self) -> np.ndarray:
        return self.data

    def release(self) -> None:
        """Nothing to give back."""
