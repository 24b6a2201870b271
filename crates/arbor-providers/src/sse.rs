//! SSE decoding of provider response bodies.
