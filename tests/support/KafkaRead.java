// Reads a topic from its beginning with Apache Kafka's own Java consumer (kafka-clients,
// from the broker's jars) and prints one JSON line per record: partition, offset, key,
// value, headers, and the partition Kafka's Java partitioner picks for the key
// (Utils.murmur2, as its DefaultPartitioner/BuiltInPartitioner does). Run as a Java
// single-file program: java -cp "$OUTBOX_KAFKA_LIB/*" KafkaRead.java BOOTSTRAP TOPIC COUNT [IDLE_MS
// [ISOLATION]] (ISOLATION: read_committed, the default, or read_uncommitted: aborted records too)
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.*;
import org.apache.kafka.clients.consumer.*;
import org.apache.kafka.common.*;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.utils.Utils;

public class KafkaRead {
    static String quote(byte[] b) {
        if (b == null) return "null";
        String s = new String(b, StandardCharsets.UTF_8);
        StringBuilder out = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            if (c == '"' || c == '\\') out.append('\\').append(c);
            else if (c < 0x20) out.append(String.format("\\u%04x", (int) c));
            else out.append(c);
        }
        return out.append('"').toString();
    }

    public static void main(String[] args) {
        Properties p = new Properties();
        p.put("bootstrap.servers", args[0]);
        p.put("key.deserializer", ByteArrayDeserializer.class.getName());
        p.put("value.deserializer", ByteArrayDeserializer.class.getName());
        p.put("enable.auto.commit", "false");
        p.put("isolation.level", args.length > 4 ? args[4] : "read_committed");
        int wanted = Integer.parseInt(args[2]);
        long idle = args.length > 3 ? Long.parseLong(args[3]) : 15000;  // ms without a record
        try (KafkaConsumer<byte[], byte[]> c = new KafkaConsumer<>(p)) {
            List<TopicPartition> parts = new ArrayList<>();
            for (PartitionInfo i : c.partitionsFor(args[1])) parts.add(new TopicPartition(args[1], i.partition()));
            int n = parts.size();
            c.assign(parts);
            c.seekToBeginning(parts);
            int seen = 0;
            long idleUntil = System.currentTimeMillis() + idle;
            while (seen < wanted && System.currentTimeMillis() < idleUntil) {
                for (ConsumerRecord<byte[], byte[]> r : c.poll(Duration.ofMillis(500))) {
                    StringBuilder h = new StringBuilder("{");
                    for (Header x : r.headers()) {
                        if (h.length() > 1) h.append(',');
                        h.append(quote(x.key().getBytes(StandardCharsets.UTF_8))).append(':').append(quote(x.value()));
                    }
                    h.append('}');
                    int java = r.key() == null ? -1 : Utils.toPositive(Utils.murmur2(r.key())) % n;
                    System.out.println("{\"partition\":" + r.partition() + ",\"offset\":" + r.offset()
                        + ",\"key\":" + quote(r.key()) + ",\"value\":" + quote(r.value())
                        + ",\"headers\":" + h + ",\"java_partition\":" + java + "}");
                    seen++;
                    idleUntil = System.currentTimeMillis() + idle;
                }
            }
        }
    }
}
