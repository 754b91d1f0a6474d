"""Reading a converted dataset's marker from wherever it lives."""

import json

import fsspec
import pytest

from vitkit.data.shards import FORMAT, MARKER, read_dataset_info


def test_a_dataset_in_an_object_store_is_read_through_fsspec():
    """An object-store URL goes through fsspec (memory:// stands in for s3:// here); a URL without the marker
    is refused with the URL it tried."""
    info = {"format": FORMAT, "classes": ["a", "b"], "splits": {"train": 4, "val": 2}, "order": "shuffled"}
    fs = fsspec.filesystem("memory")
    fs.pipe(f"/bucket/ds/{MARKER}", json.dumps(info).encode())
    assert read_dataset_info("memory://bucket/ds/") == info
    with pytest.raises(FileNotFoundError, match=f"cannot read memory://bucket/none/{MARKER}"):
        read_dataset_info("memory://bucket/none")
