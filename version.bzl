# kvferry's release, in the C library (kvferry_version()) and the wheel.
KVFERRY_VERSION = "0.3.0"
