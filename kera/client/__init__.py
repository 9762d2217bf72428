"""What every client shares: its environment, the request thread, the stream cache, the Admin client."""
