"""GPU implementations: argument marshalling and kernel launches, one module per op."""
