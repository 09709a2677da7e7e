"""What a workspace that depends on kvferry adds after its local_repository:

    local_repository(name = "kvferry", path = "/path/to/kvferry")
    load("@kvferry//:deps.bzl", "kvferry_dependencies")
    kvferry_dependencies()

Declares, unless the workspace already has them: @sys (Debian's libraries
under /usr: Abseil, libibverbs, librdmacm, OpenSSL, ...), and offline
stand-ins for @rules_cc and @rules_java, which Bazel 4 would otherwise try
to download.
"""

def _kvferry_dir_impl(ctx):
    # A directory of kvferry's third_party/, as a repository of its own.
    src = ctx.path(Label("//third_party:BUILD.bazel")).dirname.get_child(ctx.attr.dir)
    for child in src.readdir():
        ctx.symlink(child, child.basename)

_kvferry_dir = repository_rule(
    implementation = _kvferry_dir_impl,
    attrs = {"dir": attr.string(mandatory = True)},
    local = True,
)

def kvferry_dependencies():
    if not native.existing_rule("rules_cc"):
        _kvferry_dir(name = "rules_cc", dir = "rules_cc")
    if not native.existing_rule("rules_java"):
        _kvferry_dir(name = "rules_java", dir = "rules_java")
    if not native.existing_rule("sys"):
        native.new_local_repository(
            name = "sys",
            build_file = "@kvferry//third_party:sys.BUILD",
            path = "/usr",
        )
