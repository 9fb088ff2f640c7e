"""Checkpoint images: torpor checkpoints as standard OCI checkpoint images, moved through a
registry (docs/registries.md).

    oci.py       media types, annotations, descriptors and the manifests read back (untrusted)
    layer.py     the one layer: written from a checkpoint, unpacked with every path checked
    build.py     `torpor image build`: a checkpoint directory or archive -> an OCI layout
    auth.py      the containers auth-file and certs.d conventions (podman's)
    client.py    the registry's HTTP API (distribution spec): blobs, uploads, manifests
    transfer.py  push (only what the registry lacks, resumable) and pull (every blob verified)
"""
