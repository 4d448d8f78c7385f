"""TensorBoard's own side of the event-file tests (common/tensorboard.h), with the tensorboard package
(no TensorFlow: its protobuf classes and record framing).

  tensorboard_reference.py write SPEC OUT
      Writes the events of SPEC (JSON: a list of {"wall_time", "step", and one of "file_version",
      "scalars": [[tag, value], ...], "text": [tag, text]}) to the file OUT with TensorBoard's
      RecordWriter and protobuf messages, for a byte-for-byte comparison with ours.
  tensorboard_reference.py read FILE OUT
      Reads the event file FILE with TensorBoard's loader (which checks both CRCs of every record) and
      writes OUT (JSON: a list of {"wall_time", "step", "file_version"?, "values": [{"tag", "simple_value"
      | "text", "plugin"}]}). The loader stops at a record whose CRC fails or that is cut short (as at
      one still being written); a record that is not an Event exits 1, naming the error.
  tensorboard_reference.py accumulate DIR OUT
      Loads the folder DIR as TensorBoard's UI does (EventAccumulator) and writes OUT (JSON: {"scalars":
      {tag: [[step, value], ...]}, "text": {tag: [[step, text], ...]}}).
"""
import json
import sys

from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2


def event_of(spec):
    e = event_pb2.Event(wall_time=spec["wall_time"], step=spec.get("step", 0))
    if "file_version" in spec:
        e.file_version = spec["file_version"]
    elif "scalars" in spec:
        for tag, v in spec["scalars"]:
            e.summary.value.add(tag=tag, simple_value=v)
    else:
        tag, text = spec["text"]
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()])
        tensor.tensor_shape.CopyFrom(tensor_shape_pb2.TensorShapeProto())
        metadata = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
        e.summary.value.add(tag=tag, tensor=tensor, metadata=metadata)
    return e


def write(spec_path, out):
    from tensorboard.summary.writer.record_writer import RecordWriter

    with open(spec_path) as f:
        events = json.load(f)
    with open(out, "wb") as f:
        w = RecordWriter(f)
        for spec in events:
            w.write(event_of(spec).SerializeToString())
        w.flush()


def read(path, out):
    # The events as stored: the legacy loader leaves out the compat layer that rewrites simple_value
    # into the scalars plugin's tensors (the accumulator below applies it).
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    rows = []
    try:
        for e in LegacyEventFileLoader(path).Load():
            row = {"wall_time": e.wall_time, "step": e.step}
            if e.HasField("file_version"):
                row["file_version"] = e.file_version
            values = []
            for v in e.summary.value:
                item = {"tag": v.tag, "plugin": v.metadata.plugin_data.plugin_name}
                if v.HasField("simple_value"):
                    item["simple_value"] = v.simple_value
                if v.HasField("tensor"):
                    item["text"] = [s.decode(errors="replace") for s in v.tensor.string_val]
                    item["dims"] = len(v.tensor.tensor_shape.dim)
                values.append(item)
            row["values"] = values
            rows.append(row)
    except Exception as err:  # a protobuf DecodeError
        print(f"{path}: {type(err).__name__}: {err}", file=sys.stderr)
        sys.exit(1)
    with open(out, "w") as f:
        json.dump(rows, f)


def accumulate(folder, out):
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(folder, size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    scalars = {tag: [[s.step, s.value] for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    text = {}
    try:
        text_tags = acc.PluginTagToContent("text")
    except KeyError:  # no text in the folder
        text_tags = {}
    for tag in text_tags:
        text[tag] = [[t.step, t.tensor_proto.string_val[0].decode(errors="replace")] for t in acc.Tensors(tag)]
    with open(out, "w") as f:
        json.dump({"scalars": scalars, "text": text}, f)


if __name__ == "__main__":
    {"write": write, "read": read, "accumulate": accumulate}[sys.argv[1]](*sys.argv[2:4])
