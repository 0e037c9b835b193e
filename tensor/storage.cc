#include "tensor/storage.h"

#include "tensor/error.h"

namespace tessera {

StorageImpl::StorageImpl(int64_t nbytes, Device device)
    : nbytes_(nbytes), device_(device), allocator_(&storage_allocator(device)) {
  reallocate();
}

void StorageImpl::reallocate() {
  TS_CHECK(allocator_ != nullptr, "Storage::reallocate: the storage wraps external memory");
  if (data_ != nullptr) return;
  data_ = allocator_->allocate(nbytes_);
  tag_ = MemoryTagScope::current();
  if (!allocator_->is_device()) return;  // the host tier counts itself (allocator.h)
  tracker_ = MemoryScope::current();
  if (tracker_ != nullptr) tracker_->add(nbytes_, tag_);
  process_memory().add(nbytes_, tag_);
}

void StorageImpl::release() {
  TS_CHECK(allocator_ != nullptr, "Storage::release: the storage wraps external memory");
  if (data_ == nullptr || nbytes_ == 0) return;  // an empty storage is never "released"
  allocator_->deallocate(data_, nbytes_);
  if (allocator_->is_device()) {
    if (tracker_ != nullptr) tracker_->sub(nbytes_, tag_);
    process_memory().sub(nbytes_, tag_);
  }
  data_ = nullptr;
}

StorageImpl::StorageImpl(void* data, int64_t nbytes, Device device,
                         std::function<void(void*)> deleter)
    : data_(data), nbytes_(nbytes), device_(device), deleter_(std::move(deleter)) {}

StorageImpl::~StorageImpl() {
  if (allocator_ != nullptr) {
    if (data_ != nullptr) {
      allocator_->deallocate(data_, nbytes_);
      if (allocator_->is_device()) {
        if (tracker_ != nullptr) tracker_->sub(nbytes_, tag_);
        process_memory().sub(nbytes_, tag_);
      }
    }
  } else if (deleter_) {
    deleter_(data_);
  }
}

}  // namespace tessera
