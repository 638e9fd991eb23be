"""Videos: one file, one item, one ``mm_hash``, its sampled frames' rows. The header is read and
checked against the video limits and the family plans its sampling (:func:`plan_video`) before a
frame is decoded; the family's figure for decoding it is charged to the request-memory budget;
then only the frames up to the last sampled one are decoded (``video.decode_frames``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from encode_server.config import Settings
from encode_server.core.errors import BadInput, TooLarge, UnsupportedMediaType
from encode_server.core.types import VIDEO, VideoInfo
from encode_server.encoders.base import Encoder, PreparedItem, VideoPlan

from .base import ItemKind, TokenCount

__all__ = ["VideoKind", "plan_video"]


def plan_video(
    encoder: Encoder, settings: Settings, data: bytes, index: int, item_settings: Mapping[str, Any] | None = None
) -> tuple[VideoInfo, VideoPlan]:
    """A video's header read and checked against the limits, and its sampling planned by its family:
    before any frame is decoded (``/v1/tokens`` stops here). ``item_settings``: the item's effective
    per-request settings (their ``fps`` in place of ``--video-fps``), None for the server's."""
    from encode_server.video import probe

    s = settings
    info = probe(data, index=index)
    if info.codec == "gif":
        raise UnsupportedMediaType(
            "a GIF is an image for this model (vLLM reads its first frame): send it as an image",
            type="unsupported_video", index=index,
        )
    if info.duration > s.max_video_seconds:
        raise TooLarge(f"video is {info.duration:.1f} s long, above the limit of {s.max_video_seconds:g} s "
                       "(--max-video-seconds)",
                       type="video_too_large", index=index)
    if info.width * info.height > s.max_image_pixels:
        raise TooLarge(f"video frames are {info.width}x{info.height}, above the limit of {s.max_image_pixels} "
                       "pixels (--max-image-pixels)", type="video_too_large", index=index)
    try:
        plan = encoder.plan_video(info, float((item_settings or {}).get("fps", s.video_fps)))
    except ValueError as exc:
        raise BadInput(f"video cannot be preprocessed: {exc}", type="invalid_video", index=index) from exc
    if len(plan.indices) > s.max_video_frames:
        raise TooLarge(f"video samples {len(plan.indices)} frames, above the limit of {s.max_video_frames} "
                       "(--max-video-frames)",
                       type="video_too_large", index=index)
    # Every frame up to the last sampled one is decoded (inter-frame codecs): a header that
    # claims a high frame rate asks for that much decoding in a few seconds of "duration".
    if (decoded := max(plan.indices) + 1) > s.max_video_decoded_frames:
        raise TooLarge(f"video needs {decoded} frames decoded ({info.num_frames} at {info.fps:g} fps), above the "
                       f"limit of {s.max_video_decoded_frames} (--max-video-decoded-frames)", type="video_too_large",
                       index=index)
    return info, plan


class VideoKind(ItemKind):
    """A video; a long one goes to the batcher in runs of whole temporal groups (``split``), each
    its own forward pass, so other requests' items are batched between them."""

    modality = VIDEO
    plural = "videos"

    def prepare(self, data: bytes, index: int, settings: Mapping[str, Any] | None) -> PreparedItem:
        from encode_server.video import decode_frames

        info, plan = plan_video(self.encoder, self.settings, data, index, settings)
        with self.memory.bytes(plan.nbytes, index, "decoding this video"):
            frames = decode_frames(data, plan.indices, size=(info.height, info.width), index=index)
            try:
                return self.encoder.preprocess_video(frames, plan)
            except ValueError as exc:
                raise BadInput(f"video cannot be preprocessed: {exc}", type="invalid_video", index=index) from exc
            finally:
                del frames

    def count(self, data: bytes, index: int, settings: Mapping[str, Any] | None) -> TokenCount:
        """From the container's header: no frame is decoded."""
        info, plan = plan_video(self.encoder, self.settings, data, index, settings)
        return TokenCount(index, info.width, info.height, plan.num_tokens, plan.meta)

    def split(self, prepared: PreparedItem, max_cost: int) -> list[PreparedItem]:
        return self.encoder.split(prepared, max_cost)
