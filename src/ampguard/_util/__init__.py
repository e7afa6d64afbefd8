"""Private helpers shared across ampguard's packages (layer 0: imports nothing else of ampguard,
never imports torch). Not public API."""
