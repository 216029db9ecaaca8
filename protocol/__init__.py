"""hermes-sup wire protocol: messages, signed frames, limits. No I/O, no zmq.

Everything else in hermes-sup depends on this package; it depends on none of them.
"""

from .errors import ErrorCode, LocalProtocolError, ProtocolError, RemoteProtocolError
from .exits import WorkerExit, describe_exit
from .messages import BODY_SCHEMAS, Kind, Message, error_message, new_id
from .session_keys import KEY_RULE, MAX_KEY_LENGTH, check_session_key, session_dir_name
from .wire import (
    DEFAULT_MAX_FRAME_SIZE,
    MAGIC,
    MAX_WATCHES_PER_CLIENT,
    PROTOCOL_VERSION,
    Limits,
    ReplayGuard,
    decode,
    encode,
    sign,
)

__all__ = [
    "BODY_SCHEMAS",
    "DEFAULT_MAX_FRAME_SIZE",
    "KEY_RULE",
    "MAGIC",
    "MAX_KEY_LENGTH",
    "MAX_WATCHES_PER_CLIENT",
    "PROTOCOL_VERSION",
    "ErrorCode",
    "Kind",
    "Limits",
    "LocalProtocolError",
    "Message",
    "ProtocolError",
    "RemoteProtocolError",
    "ReplayGuard",
    "WorkerExit",
    "check_session_key",
    "decode",
    "describe_exit",
    "encode",
    "error_message",
    "new_id",
    "session_dir_name",
    "sign",
]
