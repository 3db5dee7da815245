"""HTTP plumbing below the routes: request limits and timeouts, API key and body size (pure ASGI)."""
