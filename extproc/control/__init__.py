"""Request control: a request's life (route, decide, lease, hand over, release) and the load view."""
