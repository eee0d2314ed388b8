"""The wire: message framing and the per-connection protocol state (sans-IO), chunk sets, fleet keys (CURVE)."""
