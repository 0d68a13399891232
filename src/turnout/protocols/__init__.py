"""Wire types shared by every layer: msgspec structs, JSON at the HTTP edge, msgpack inside."""
