"""Peer sync between ``serve`` replicas over ZMQ (see :mod:`extproc.peers.sync`)."""
