"""Plain data the engine and the bank share: a turn's live caches (turn.py) and independent
snapshots of them (snapshot.py). Both import from here; this package imports neither."""
