"""The one emitter of bdlora's decoder graphs (both runtimes, and bench's projection stack): ``builder`` (nodes,
projections in their deployed form, shared first stages), ``attention`` (one part per runtime), ``graph`` (layouts,
the decoder, the projection stack)."""

from bdlora.export.decoder.graph import (
    DecoderLayout,
    build_decoder,
    build_projection_stack,
    decoder_graph,
    save_graph,
)

__all__ = ["DecoderLayout", "build_decoder", "build_projection_stack", "decoder_graph", "save_graph"]
