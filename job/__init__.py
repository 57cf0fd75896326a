"""The Kafka-free floor that turns a job file into parts."""
